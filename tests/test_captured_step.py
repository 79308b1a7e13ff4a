"""``execution.compile``: the batched backend's local step captured with torch.compile
(engine/captured_step.py) gives the eager batched backend's model (float64 1e-10, float32 1e-5
relative) on every capturable model and client rule, compiles at most one program per size
class it meets, runs the models it cannot capture eagerly (saying so) and is refused at config
load where the step is not one program.

Most tests use torch.compile's cheap ``aot_eager`` backend (dynamo's capture and AOT
autograd's functional graph, run by eager kernels) or a counting backend; one small test runs
inductor, the backend ``execution.compile = "on"`` uses on the CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import tomllib
from typing import ClassVar

import numpy as np
import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from fedsub import config as config_lib
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.engine import captured_step
from fedsub.engine.captured_step import PaddedCohort, size_class
from fedsub.engine.execution import Compile, Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.errors import ConfigError
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.models.pooling import sum_pool
from fedsub.models.registry import build_model
from fedsub.runs.run_setup import schedule_of
from fedsub.submodel.index import SubmodelIndex

from .test_backends import setup, shared_table_dataset, two_tables_with_dense
from .test_resume_matrix import OPTIONS, SMALL_WIDTHS, dataset_for

CHEAP = Compile("aot_eager")
# torch 2.11's compiler fails on the local step (captured_step.COMPILE_NEEDS_TORCH): the tests
# that compile run where fedsub compiles, and the refusal is tested below on any torch.
needs_compile = pytest.mark.skipif(
    captured_step.compile_unavailable() is not None,
    reason=str(captured_step.compile_unavailable()),
)


def relative_difference(a, b) -> float:
    worst = 0.0
    for name, value in a.state_dict().items():
        other = b.state_dict()[name]
        scale = value.abs().max().clamp(min=1e-30)
        worst = max(worst, float((value - other).abs().max() / scale))
    return worst


def assert_same_model(eager, captured, dtype) -> None:
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    assert relative_difference(eager, captured) <= tolerance
    for name, value in eager.state_dict().items():
        assert value.abs().max() > 1e-3, name  # every tensor moved from its init


def run_both(model, algorithm, dataset, index, schedule: Schedule, compile: Compile = CHEAP):
    eager = train(model, algorithm, dataset, index, schedule)
    compiled = dataclasses.replace(
        schedule, execution=dataclasses.replace(schedule.execution, compile=compile)
    )
    captured = train(model, algorithm, dataset, index, compiled)
    return eager, captured


def fedsubavg(dataset, index, clients: int):
    return build_algorithm("fedsubavg", AlgorithmContext(dataset, index, "samples", clients))


# --- size classes and padding ------------------------------------------------------------------
def test_size_classes_are_four_per_doubling_from_sixteen():
    sizes = (0, 1, 16, 17, 20, 21, 32, 33, 100, 1000, 1025)
    assert [size_class(n) for n in sizes] == [16, 16, 16, 20, 20, 24, 32, 40, 112, 1024, 1280]
    for n in range(1, 5000):
        assert n <= size_class(n) < max(1.25 * n, 17)  # under a quarter wasted
    assert len({size_class(n) for n in range(1000, 2001)}) == 5


def test_padding_keeps_every_real_sample_and_row():
    """The padded ids pool to the same features for the real samples (plus one phantom sample
    of padding rows), and the padded table keeps the real rows first."""
    rng = np.random.default_rng(0)
    table = torch.from_numpy(rng.normal(size=(5, 3)))
    values = torch.tensor([0, 4, 4, 2, 1, 3, 0])
    offsets = torch.tensor([0, 2, 2, 5, 7])  # four samples, one of them empty
    padding = PaddedCohort.of({"t": 5}, {"f": "t"})
    assert padding.padded_rows == {"t": 16}
    padded_table = padding.tables({"t": table})["t"]
    (padded_values, padded_offsets) = padding.ids({"f": (values, offsets)})["f"]
    assert len(padded_values) == 16 and padded_offsets.tolist() == [0, 2, 2, 5, 7, 16]
    assert padded_values[7:].eq(5).all()  # the first padding row
    pooled = sum_pool(padded_table, padded_values, padded_offsets)
    assert torch.equal(pooled[:4], sum_pool(table, values, offsets))
    assert pooled[4].eq(0).all()
    assert torch.equal(padding.cut({"t": padded_table})["t"], table)


# --- compiled step == eager step ----------------------------------------------------------------
MODELS = ["embedding-lr", "softmax-regression", "linear-regression", "mlp", "cnn"]


@needs_compile
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", MODELS)
def test_the_captured_step_gives_the_eager_model_on_every_capturable_model(
    name, dtype, tmp_path_factory
):
    dataset, index = dataset_for(name, str(tmp_path_factory.getbasetemp()))
    options = {**OPTIONS, "widths": SMALL_WIDTHS.get(name, [])}
    model = build_model(name, dataset, options)
    schedule = Schedule(
        3, 3, local=LocalWork(2, 3, ClientStep(lr=0.3)), seed=4, execution=Execution(dtype=dtype)
    )
    eager, captured = run_both(model, fedsubavg(dataset, index, 3), dataset, index, schedule)
    assert_same_model(eager, captured, dtype)


RULES = {  # the client transforms: proximal term, clipping, decay, momentum, SCAFFOLD, Adam
    "fedprox": ("fedprox", {}),
    "clip-decay-momentum": (
        "fedsubavg",
        {"clip_norm": 0.05, "weight_decay": 0.01, "momentum": 0.5},
    ),
    "scaffold": ("scaffold", {}),
    "client-adam": ("sub-adam", {}),
}
COMPOSED = tomllib.loads(
    '[algorithms.sub-adam]\naggregation = "fedsubavg"\nclient = ["adam", "prox"]\nmu = 0.1\n'
    "[algorithms.fedprox]\nmu = 0.5\n"
)


def rule_case(rule: str, rounds: int, lr_schedule: str = "constant") -> tuple:
    """(model, algorithm, dataset, index, schedule) of one of ``RULES`` on two tables with
    dense inputs and ragged ids (empty lists included), float64."""
    name, extra = RULES[rule]
    dataset = two_tables_with_dense(0)
    index = SubmodelIndex.build(dataset)
    model = EmbeddingLogisticRegression(dict(dataset.table_rows), embedding_dim=4, init_std=0.3)
    config = config_lib.parse({"train": {"algorithms": [name]}, **COMPOSED})
    context = AlgorithmContext(dataset, index, "samples", 5)
    algorithm = build_algorithm(name, context, config.algorithm_options(name))
    step = ClientStep(lr=0.3, lr_schedule=lr_schedule, **extra)
    schedule = Schedule(
        rounds, 5, LocalWork(2, 4, step), seed=1, execution=Execution(dtype=torch.float64)
    )
    return model, algorithm, dataset, index, schedule


def shared_table_case() -> tuple:
    """(model, algorithm, dataset, index, schedule): two fields reading one table, float64."""
    dataset = shared_table_dataset()
    index = SubmodelIndex.build(dataset)
    model = EmbeddingLogisticRegression(
        dict(dataset.table_rows),
        embedding_dim=3,
        init_std=0.3,
        fields=tuple(dataset.train.ids),
        field_tables=dict(dataset.field_tables),
    )
    schedule = Schedule(
        3,
        3,
        local=LocalWork(2, 3, ClientStep(lr=0.3)),
        seed=0,
        execution=Execution(dtype=torch.float64),
    )
    return model, fedsubavg(dataset, index, 3), dataset, index, schedule


@needs_compile
@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_captured_step_gives_the_eager_model_with_every_client_rule(rule):
    eager, captured = run_both(*rule_case(rule, rounds=3))
    assert_same_model(eager, captured, torch.float64)


@needs_compile
def test_fields_sharing_a_table_pad_into_that_table():
    eager, captured = run_both(*shared_table_case())
    assert_same_model(eager, captured, torch.float64)


@needs_compile
def test_the_cuda_graph_loop_keeps_copies_and_gives_the_eager_model(monkeypatch):
    """On CUDA (``mode="reduce-overhead"``) every step starts a cudagraph step and copies its
    outputs before the next replay overwrites them: the same loop, run here on the CPU."""
    run_steps = captured_step.run_steps
    calls = []

    def as_on_cuda(*args, **options):
        calls.append(options)
        return run_steps(*args, **{**options, "cuda_graphs": True})

    monkeypatch.setattr(captured_step, "run_steps", as_on_cuda)
    dataset, index, model = setup("synthetic")
    schedule = Schedule(
        3,
        4,
        local=LocalWork(3, 3, ClientStep(lr=0.3, momentum=0.5)),
        seed=1,
        execution=Execution(dtype=torch.float64),
    )
    eager, captured = run_both(model, fedsubavg(dataset, index, 4), dataset, index, schedule)
    assert calls == [{"cuda_graphs": False}] * 3
    assert_same_model(eager, captured, torch.float64)


@needs_compile
# --- a bounded number of programs ---------------------------------------------------------------
def test_a_run_compiles_at_most_one_program_per_size_class(monkeypatch):
    """Ten rounds meet many shapes (rows per round, ids per step) but few size classes; the
    compilations are bounded by the classes, not by the shapes."""
    torch._dynamo.reset()
    shapes: set[tuple[int, ...]] = set()
    classes: set[tuple[int, ...]] = set()
    ids_of = PaddedCohort.ids

    def recorded(self, ids):
        shapes.add((*self.real_rows.values(), *(len(v) for v, _ in ids.values())))
        padded = ids_of(self, ids)
        classes.add(self.key(padded))
        return padded

    monkeypatch.setattr(PaddedCohort, "ids", recorded)
    dataset, index, model = setup("synthetic")
    counter = CompileCounterWithBackend("aot_eager")
    schedule = Schedule(
        10,
        7,
        local=LocalWork(4, 3, ClientStep(lr=0.3)),
        seed=2,
        execution=Execution(dtype=torch.float64, compile=Compile(counter)),
    )
    train(model, fedsubavg(dataset, index, 7), dataset, index, schedule)
    assert len(shapes) > 2 * len(classes)  # the padding is what bounds the programs
    assert 1 <= counter.frame_count <= len(classes)


# --- what is not captured -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ValueShaped(EmbeddingLogisticRegression):
    """Stands for DIN and LSTM: a model whose shapes depend on its ids' values."""

    capturable: ClassVar[bool] = False


def test_a_model_with_value_dependent_shapes_runs_eagerly_and_says_so(caplog):
    dataset, index, _ = setup("synthetic")
    model = ValueShaped(dict(dataset.table_rows), embedding_dim=4, init_std=0.3)
    counter = CompileCounterWithBackend("eager")
    schedule = Schedule(
        2,
        4,
        local=LocalWork(2, 3, ClientStep(lr=0.3)),
        seed=0,
        execution=Execution(dtype=torch.float64),
    )
    captured_step._TOLD.discard("ValueShaped")
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        eager, captured = run_both(
            model, fedsubavg(dataset, index, 4), dataset, index, schedule, Compile(counter)
        )
    assert counter.frame_count == 0
    assert relative_difference(eager, captured) == 0
    assert "model ValueShaped runs its local steps eagerly" in caplog.text


@pytest.mark.parametrize(
    "version, refused",
    [("2.11.0+cu130", True), ("2.12.1", True), ("2.13.0+cpu", False), ("2.14.1", False)],
)
def test_a_torch_older_than_the_tested_one_cannot_compile_and_says_which(version, refused):
    reason = captured_step.compile_unavailable(version)
    assert (reason is not None) == refused
    if refused:
        assert "torch >= 2.13" in str(reason) and version in str(reason)


def test_on_an_older_torch_the_step_runs_eagerly_with_the_reason(monkeypatch, caplog):
    monkeypatch.setattr(
        captured_step, "compile_unavailable", lambda: "it needs torch >= 2.13 (this is 2.11.0)"
    )
    model = EmbeddingLogisticRegression({"t": 5}, embedding_dim=2)
    captured_step._TOLD.discard("EmbeddingLogisticRegression")
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        assert captured_step.capture_for(model, False, CHEAP) is None
    assert "runs its local steps eagerly: it needs torch >= 2.13" in caplog.text
    captured_step._TOLD.discard("EmbeddingLogisticRegression")


def test_the_config_refuses_compile_on_an_older_torch(monkeypatch):
    monkeypatch.setattr(
        config_lib, "compile_unavailable", lambda: captured_step.compile_unavailable("2.11.0")
    )
    with pytest.raises(
        ConfigError,
        match=r'execution\.compile = "on" cannot be used here: it '
        r"needs torch >= 2\.13 \(this is torch 2\.11\.0",
    ):
        parse({})


# --- config ------------------------------------------------------------------------------------
def parse(train: dict):
    return config_lib.parse({"train": {"compile": "on", **train}})


@needs_compile
def test_train_compile_is_off_by_default_and_on_gives_inductor():
    assert config_lib.parse({}).execution.compile == "off"
    assert schedule_of(config_lib.parse({})).execution.compile is None
    assert schedule_of(parse({})).execution.compile == Compile("inductor", None)
    assert Compile.for_device(torch.device("cuda")) == Compile("inductor", "reduce-overhead")
    with pytest.raises(ConfigError, match=r"execution\.compile"):
        config_lib.parse({"train": {"compile": "yes"}})


@pytest.mark.parametrize(
    "train, names",
    [
        ({"backend": "sequential"}, "execution.backend = 'sequential'"),
        ({"masking": "static"}, "masking.scheme = 'static'"),
        ({"deterministic": True}, "execution.deterministic = true"),
    ],
)
def test_settings_whose_step_cannot_be_captured_are_refused_naming_both_keys(train, names):
    config = {"model": {"name": "mlp"}} if "masking" in train else {}
    with pytest.raises(ConfigError) as error:
        config_lib.parse({**config, "train": {"compile": "on", **train}})
    assert 'execution.compile = "on" cannot be used here' in str(error.value)
    assert names in str(error.value)


def test_the_command_line_refuses_it_with_exit_code_2(tmp_path, capsys):
    from fedsub.cli import main

    path = tmp_path / "c.toml"
    path.write_text('[train]\ncompile = "on"\nbackend = "sequential"\n')
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    assert 'c.toml: execution.compile = "on" cannot be used here' in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@needs_compile
# --- inductor -----------------------------------------------------------------------------------
def test_inductor_gives_the_eager_model():
    """The backend ``execution.compile = "on"`` uses on the CPU: generated C++ kernels."""
    dataset, index, model = setup("synthetic")
    schedule = Schedule(
        2,
        4,
        local=LocalWork(2, 3, ClientStep(lr=0.3)),
        seed=2,
        execution=Execution(dtype=torch.float64),
    )
    eager, captured = run_both(
        model, fedsubavg(dataset, index, 4), dataset, index, schedule, Compile("inductor")
    )
    assert_same_model(eager, captured, torch.float64)
