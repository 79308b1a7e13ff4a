"""``execution.compile = "cuda-graphs"``: a round's local steps replayed from static buffers
(engine/cuda_graphs.py).

On the CPU the capture is stood in for by ``capture_eagerly`` (each replay calls the recorded
steps): everything but ``torch.cuda.graph`` itself runs, the padding, the static buffers
refilled every round, one recorded round per size-class combination, and the model must be
the eager batched backend's **bit for bit** (the same kernels in the same order; the padding
adds exact zeros). ``tests/test_cuda.py`` runs the real capture on a GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fedsub import config as config_lib
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.engine import cuda_graphs
from fedsub.engine.captured_step import PaddedCohort
from fedsub.engine.cohort_batches import cohort_batches
from fedsub.engine.execution import CudaGraphs, Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.errors import ConfigError
from fedsub.models.pooling import sum_pool
from fedsub.models.registry import build_model
from fedsub.runs.run_setup import schedule_of
from fedsub.submodel.device_data import DeviceData
from fedsub.submodel.index import SubmodelIndex

from .test_backends import setup, two_tables_with_dense
from .test_captured_step import RULES, rule_case, shared_table_case
from .test_resume_matrix import OPTIONS, SMALL_WIDTHS, dataset_for

ON_CPU = CudaGraphs(capture=cuda_graphs.capture_eagerly)


def run_both(model, algorithm, dataset, index, schedule: Schedule):
    eager = train(model, algorithm, dataset, index, schedule)
    graphed = dataclasses.replace(
        schedule, execution=dataclasses.replace(schedule.execution, compile=ON_CPU)
    )
    return eager, train(model, algorithm, dataset, index, graphed)


def assert_identical(eager, graphed) -> None:
    for name, value in eager.state_dict().items():
        assert torch.equal(value, graphed.state_dict()[name]), name
        assert value.abs().max() > 1e-3, name  # every tensor moved from its init


def fedsubavg(dataset, index, clients: int):
    return build_algorithm("fedsubavg", AlgorithmContext(dataset, index, "samples", clients))


@pytest.mark.parametrize("name", ["embedding-lr", "softmax-regression", "linear-regression"])
def test_replayed_rounds_give_the_eager_model_bit_for_bit(name, tmp_path_factory):
    cuda_graphs._ROUNDS.clear()
    dataset, index = dataset_for(name, str(tmp_path_factory.getbasetemp()))
    model = build_model(name, dataset, {**OPTIONS, "widths": SMALL_WIDTHS.get(name, [])})
    schedule = Schedule(
        4, 3, LocalWork(2, 3, ClientStep(lr=0.3)), seed=4, execution=Execution(dtype=torch.float64)
    )
    eager, graphed = run_both(model, fedsubavg(dataset, index, 3), dataset, index, schedule)
    assert_identical(eager, graphed)
    assert cuda_graphs._ROUNDS  # the rounds were replayed, not run eagerly


@pytest.mark.parametrize("algorithm", ["fedprox", "fedsubavg", "scaffold"])
def test_din_packed_histories_replay_with_the_phantom_member(algorithm, tmp_path_factory):
    """DIN packs each member's histories: the phantom member's padding rows are laid out as
    any member's. Within float64 rounding (1e-10, as the captured step), not bit for bit: one
    more member changes the batched matmuls' shapes, which the CPU's BLAS blocks differently
    (seen: 1e-16); and FedSubAvg's eager step keeps DIN's wide weights as low-rank changes."""
    cuda_graphs._ROUNDS.clear()
    dataset, index = dataset_for("din", str(tmp_path_factory.getbasetemp()))
    model = build_model("din", dataset, OPTIONS)
    schedule = Schedule(
        3, 3, LocalWork(2, 3, ClientStep(lr=0.3)), seed=4, execution=Execution(dtype=torch.float64)
    )
    algo = build_algorithm(algorithm, AlgorithmContext(dataset, index, "samples", 3))
    eager, graphed = run_both(model, algo, dataset, index, schedule)
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(graphed.state_dict()[name], value, rtol=1e-10, atol=1e-12)
    assert max(float(v.abs().max()) for v in eager.state_dict().values()) > 1e-3
    assert cuda_graphs._ROUNDS


@pytest.mark.parametrize("rule", sorted(RULES))
def test_replayed_rounds_give_the_eager_model_with_every_client_rule(rule):
    """Dense inputs, two tables, ragged ids with empty lists, every transform's state inside
    the recorded round, learning rates (a decaying schedule) and corrections refilled each
    round."""
    eager, graphed = run_both(*rule_case(rule, rounds=4, lr_schedule="inverse-round"))
    assert_identical(eager, graphed)


def test_fields_sharing_a_table_pad_into_that_table():
    eager, graphed = run_both(*shared_table_case())
    assert_identical(eager, graphed)


def test_one_round_is_recorded_per_size_class_combination(monkeypatch):
    """Rounds whose padded shapes repeat replay the recording they share: fewer recordings
    than rounds, and each recording's key differs."""
    cuda_graphs._ROUNDS.clear()
    recorded = []

    def counting(fn):
        recorded.append(fn)
        return cuda_graphs.capture_eagerly(fn)

    dataset, index, model = setup("synthetic")
    schedule = Schedule(
        12,
        4,
        LocalWork(3, 3, ClientStep(lr=0.3)),
        seed=1,
        execution=Execution(dtype=torch.float64, compile=CudaGraphs(capture=counting)),
    )
    train(model, fedsubavg(dataset, index, 4), dataset, index, schedule)
    assert 1 <= len(recorded) < 12
    assert len(recorded) == len(cuda_graphs._ROUNDS)


def test_the_padded_ids_pool_to_the_real_samples_plus_a_phantom_member():
    """Every step's ids padded to the round's largest step: the K members' samples pool to
    what the unpadded step gives, the phantom member's B samples hold only padding rows (all
    in its last sample)."""
    dataset = two_tables_with_dense(3)
    index = SubmodelIndex.build(dataset)
    data = DeviceData.of(dataset, index, torch.device("cpu"), torch.float64)
    clients = torch.tensor([0, 3, 5, 7])
    batches = cohort_batches(data, clients, seed=2, round_index=1, steps=3, batch=4)
    real = {t: len(r.values) for t, r in batches.rows.items()}
    padding = PaddedCohort.of(real, data.field_tables)
    padded = cuda_graphs.padded_ids(batches, padding)
    rng = np.random.default_rng(0)
    for field, (values, offsets) in padded.items():
        table = data.field_tables.get(field, field)
        weights = torch.from_numpy(rng.normal(size=(padding.padded_rows[table], 2)))
        assert values.shape[0] == 3 and offsets.shape == (3, 5 * 4 + 1)
        for step in range(3):
            want_values, want_offsets = batches.step_ids(step)[field]
            pooled = sum_pool(weights, values[step], offsets[step])
            assert torch.equal(pooled[:16], sum_pool(weights, want_values, want_offsets))
            assert pooled[16:19].eq(0).all()  # the phantom's samples but its last: empty
            padding_ids = values[step][len(want_values) :]
            assert padding_ids.eq(real[table]).all()
            assert torch.allclose(pooled[19], weights[real[table]] * len(padding_ids))


def test_the_rates_layout_takes_only_the_rates_it_was_recorded_with():
    layout = cuda_graphs.StaticRates(
        cuda_graphs.CohortLayout((None,), 2), torch.tensor([0.5, 0.25]), np.array([1.0, 2.0])
    )
    like = torch.zeros(2, 3)
    assert torch.equal(layout.per_member(layout.source, like), torch.tensor([0.5, 0.25]))
    with pytest.raises(ValueError, match="learning rates"):
        layout.per_member(np.array([1.0, 2.0]), like)


# --- the config ---------------------------------------------------------------------------------
def test_cuda_graphs_is_a_choice_of_execution_compile_and_needs_a_cuda_device():
    config = config_lib.parse({"execution": {"compile": "cuda-graphs", "device": "cpu"}})
    with pytest.raises(ConfigError, match=r'execution\.compile = "cuda-graphs".*CUDA device'):
        schedule_of(config)


@pytest.mark.parametrize(
    "section",
    [{"backend": "sequential"}, {"deterministic": True}],
)
def test_cuda_graphs_is_refused_where_the_steps_are_not_one_program(section):
    with pytest.raises(ConfigError, match=r'execution\.compile = "cuda-graphs" cannot be used'):
        config_lib.parse({"execution": {"compile": "cuda-graphs", **section}})
