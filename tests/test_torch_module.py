"""A user's own nn.Module as a fedsub model (fedsub.models.torch_module): the split forward
equals the module's own, both backends give the same model (every module shape, several
algorithms, privacy levels, resume), tables are found and checked with clear errors, modules
that cannot be split or vmapped run sequentially with a warning, and FedSubAvg's heat
coefficients act on the module's embedding rows exactly as on the built-in equivalent."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.data.synthetic_li import SyntheticLiOptions
from fedsub.data.synthetic_li import generate as generate_li
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.execution import Compile, Execution
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.engine.loop import Interrupted, RunControl
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.errors import ConfigError
from fedsub.models.base import Batch, forward, is_batchable
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.models.torch_module import Inputs, wrap
from fedsub.privacy.levels import Privacy
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params

from .equivalence import algorithm_for, assert_backends_match_reference
from .test_backends import shared_table_dataset, two_tables_with_dense
from .torch_modules import (
    BranchesOnValues,
    DenseClassifier,
    MaxBags,
    MeanByHand,
    SharedItem,
    SquaredError,
    SummedEmbeddingsLR,
    TwoBags,
    UserItems,
    single_and_multi_id,
)


def seeded(make, seed: int = 0):
    torch.manual_seed(seed)
    return make()


CASES = {  # name: (module factory, dataset factory)
    "two-bags": (TwoBags, lambda: two_tables_with_dense(0)),
    "max-bags": (MaxBags, lambda: two_tables_with_dense(0)),
    "shared-item": (SharedItem, shared_table_dataset),
    "user-items": (UserItems, single_and_multi_id),
    "dense-classifier": (
        lambda: DenseClassifier(5, 3),
        lambda: generate_li(SyntheticLiOptions(num_devices=6, dim=5, classes=3), 0),
    ),
    "regression": (SquaredError, lambda: two_tables_with_dense(0)),
}


def case(name: str):
    make_module, make_dataset = CASES[name]
    dataset = make_dataset()
    module = seeded(make_module)
    task = "regression" if name == "regression" else None
    return module, wrap(module, dataset, task=task), dataset


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_split_forward_equals_the_modules_own_forward(name):
    module, model, dataset = case(name)
    assert is_batchable(model)
    params = model.init(torch.Generator(), torch.float32)
    batch = Batch.from_samples(dataset.train.slice(0, 11), torch.float32)
    with torch.no_grad():
        own = module.eval()(Inputs(batch.ids, batch.dense))
        got = forward(model, params, batch)
    torch.testing.assert_close(got, own, rtol=1e-6, atol=1e-7)  # float32 rounding


@pytest.mark.parametrize("name", sorted(CASES))
def test_both_backends_give_the_reference_model(name):
    _, model, dataset = case(name)
    index = SubmodelIndex.build(dataset)
    algorithm = algorithm_for("scaffold", dataset, index, 3)  # the most stages of any round
    schedule = Schedule(
        2,
        3,
        local=LocalWork(2, 3, ClientStep(lr=0.1)),
        seed=4,
        execution=Execution(dtype=torch.float64),
    )
    assert_backends_match_reference(model, algorithm, dataset, index, schedule)


def test_the_task_and_loss_follow_the_outputs():
    assert case("two-bags")[1].task == "binary"
    _, classifier, _ = case("dense-classifier")
    assert classifier.task == "multiclass"
    outputs, labels = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0.0, 1.0])
    expected = nn.functional.cross_entropy(outputs, labels.long())
    assert torch.equal(classifier.loss(outputs, labels), expected)
    _, regression, _ = case("regression")
    assert regression.task == "regression"
    assert float(regression.loss(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 0.0]))) == 5.0


def test_init_is_the_modules_own_weights_and_to_module_writes_trained_ones_back():
    module, model, dataset = case("two-bags")
    params = model.init(torch.Generator().manual_seed(9), torch.float64)
    assert torch.equal(params.tables["a"], module.a.weight.double())
    assert torch.equal(params.dense["mlp.0.weight"], module.mlp[0].weight.double())
    assert set(params.dense) == {"mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"}
    index = SubmodelIndex.build(dataset)
    schedule = Schedule(
        2,
        3,
        local=LocalWork(2, 3, ClientStep(lr=0.5)),
        seed=1,
        execution=Execution(dtype=torch.float64),
    )
    trained = train(model, algorithm_for("fedsubavg", dataset, index, 3), dataset, index, schedule)
    back = model.to_module(trained)
    assert type(back) is TwoBags and back.training
    assert back.a.weight.dtype == torch.float32
    torch.testing.assert_close(back.a.weight, trained.tables["a"].float(), rtol=0, atol=0)
    torch.testing.assert_close(back.mlp[2].bias, trained.dense["mlp.2.bias"].float())
    assert not torch.equal(back.a.weight, module.a.weight)  # the module given is untouched...
    assert torch.equal(module.a.weight.double(), params.tables["a"])  # ...and still the init
    batch = Batch.from_samples(dataset.test.slice(0, 6), torch.float32)
    with torch.no_grad():
        mine = back.eval()(Inputs(batch.ids, batch.dense))
        fedsubs = forward(model, model.init(torch.Generator(), torch.float32), batch)
    assert not torch.allclose(mine, fedsubs)  # trained weights, not the initial ones
    with torch.no_grad():
        fedsubs = forward(
            model,
            Params(
                {t: v.float() for t, v in trained.tables.items()},
                {n: v.float() for n, v in trained.dense.items()},
            ),
            batch,
        )
    torch.testing.assert_close(mine, fedsubs)


# --- tables: found, checked ------------------------------------------------------------------


def test_tables_are_found_by_name_or_given_by_module_or_path():
    dataset = two_tables_with_dense(0)
    assert wrap(seeded(TwoBags), dataset).paths == {"a": "a", "b": "b"}
    module = seeded(lambda: SummedEmbeddingsLR({"a": 40, "b": 9}, ["a", "b"], 2))
    assert wrap(module, dataset).paths == {"a": "tables.a", "b": "tables.b"}  # last part
    with pytest.raises(ConfigError, match=r"no embedding module is named after .* table 'a'"):
        wrap(seeded(Renamed), dataset)


class Renamed(TwoBags):
    def __init__(self):
        super().__init__()
        self.users, self.goods = self.a, self.b
        del self.a, self.b

    def forward(self, batch):
        a = self.users(*batch.ids["a"])
        b = self.goods(batch.ids["b"][0], batch.ids["b"][1][:-1])
        return self.mlp(torch.cat([a, b, batch.dense], dim=-1)).squeeze(-1)


def test_tables_given_explicitly_and_their_mistakes_named():
    dataset = two_tables_with_dense(0)
    module = seeded(Renamed)
    by_path = wrap(module, dataset, tables={"a": "users", "b": "goods"})
    by_module = wrap(module, dataset, tables={"a": module.users, "b": module.goods})
    assert by_path.paths == by_module.paths == {"a": "users", "b": "goods"}
    mistakes = {
        "tables names 'c', which is not a table of dataset two-tables": {"c": "users"},
        "table 'b' .* has no module in tables": {"a": "users"},
        r"tables\['a'\] = 'user': the module has no submodule at that path": {
            "a": "user",
            "b": "goods",
        },
        "gives module 'users' for tables 'a', 'b'": {"a": "users", "b": "users"},
        "not a submodule of the model": {"a": nn.EmbeddingBag(40, 3), "b": "goods"},
        "is a Sequential; a table is an nn.Embedding or nn.EmbeddingBag": {
            "a": "mlp",
            "b": "goods",
        },
        "module 'goods' .table 'a'. has 9 rows of dimension 3; the dataset's table has 40": {
            "a": "goods",
            "b": "users",
        },
    }
    for message, tables in mistakes.items():
        with pytest.raises(ConfigError, match=message):
            wrap(module, dataset, tables=tables)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"padding_idx": 0}, "sets padding_idx"),
        ({"max_norm": 1.0}, "sets max_norm"),
        ({"sparse": True}, "sets sparse"),
    ],
)
def test_table_options_fedsub_cannot_train_are_refused(option, message):
    module = seeded(TwoBags)
    module.a = nn.EmbeddingBag(40, 3, mode="sum", include_last_offset=True, **option)
    with pytest.raises(ConfigError, match=f"module 'a' .table 'a'. {message}"):
        wrap(module, two_tables_with_dense(0))


def test_an_ambiguous_name_an_extra_embedding_and_tied_weights_are_refused():
    dataset = two_tables_with_dense(0)
    module = seeded(Renamed)
    module.left = nn.ModuleDict({"a": nn.Embedding(40, 3)})
    module.right = nn.ModuleDict({"a": nn.Embedding(40, 3)})
    ambiguous = r"table 'a' matches several embedding modules .'left.a', 'right.a'."
    with pytest.raises(ConfigError, match=ambiguous):
        wrap(module, dataset)
    module = seeded(TwoBags)
    module.position = nn.Embedding(5, 3)
    with pytest.raises(ConfigError, match=r"module.s. 'position' match no table"):
        wrap(module, dataset)
    wrap(module, dataset, tables={"a": "a", "b": "b"})  # given: the extra one is dense
    module = seeded(TwoBags)
    module.tied = nn.Linear(3, 40, bias=False)
    module.tied.weight = module.a.weight
    with pytest.raises(ConfigError, match=r"parameter 'tied.weight' is the weight of table"):
        wrap(module, dataset)


def test_a_module_reading_a_field_of_another_table_is_refused():
    class Swapped(TwoBags):
        def forward(self, batch):
            a = self.a(*batch.ids["b"])  # table a's module on table b's ids
            return self.mlp(torch.cat([a, a, batch.dense], dim=-1)).squeeze(-1)

    with pytest.raises(ConfigError, match="module 'a' holds table 'a' but reads field 'b'"):
        wrap(seeded(Swapped), two_tables_with_dense(0))


def test_batchnorm_a_failing_forward_and_a_sum_loss_are_refused():
    dataset = two_tables_with_dense(0)
    module = seeded(TwoBags)
    module.mlp.insert(1, nn.BatchNorm1d(4))
    with pytest.raises(ConfigError, match=r"'mlp.1' is a BatchNorm1d: its running statistics"):
        wrap(module, dataset)

    class ReadsMissingField(TwoBags):
        def forward(self, batch):
            return self.a(*batch.ids["c"]).sum(-1)

    with pytest.raises(ConfigError, match=r"forward failed on 8 samples of two-tables .KeyError"):
        wrap(seeded(ReadsMissingField), dataset)

    class ReadsLabels(TwoBags):
        def forward(self, batch):
            return super().forward(batch) + batch.labels

    with pytest.raises(ConfigError, match="AttributeError: 'Inputs' object has no attribute"):
        wrap(seeded(ReadsLabels), dataset)
    summed = lambda outputs, labels: ((outputs - labels) ** 2).sum()  # noqa: E731
    with pytest.raises(ConfigError, match="the loss must be the batch mean"):
        wrap(seeded(TwoBags), dataset, loss=summed, task="regression")
    with pytest.raises(ConfigError, match=r"task 'regression' .* has no default loss"):
        wrap(seeded(TwoBags), dataset, task="regression")


# --- what cannot be split or vmapped runs sequentially, saying why -----------------------------


def test_a_forward_computing_with_the_ids_runs_whole_and_sequentially(caplog):
    dataset = two_tables_with_dense(0)
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        model = wrap(seeded(MeanByHand), dataset)
    assert "cannot split its forward at the tables (split at its tables, it gives other" in (
        caplog.text
    )
    assert model.lookups is None and not is_batchable(model)
    module = seeded(MeanByHand)
    params = model.init(torch.Generator(), torch.float32)
    batch = Batch.from_samples(dataset.train.slice(0, 9), torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(
            forward(model, params, batch), module.eval()(Inputs(batch.ids, batch.dense))
        )
    index = SubmodelIndex.build(dataset)
    schedule = Schedule(
        2,
        3,
        local=LocalWork(2, 3, ClientStep(lr=0.1)),
        seed=4,
        execution=Execution(dtype=torch.float64),
    )
    assert_backends_match_reference(
        model, algorithm_for("fedavg", dataset, index), dataset, index, schedule
    )


def test_a_forward_vmap_cannot_run_is_split_but_sequential(caplog):
    dataset = two_tables_with_dense(0)
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        model = wrap(seeded(BranchesOnValues), dataset)
    assert "cannot run for a whole cohort under torch.func.vmap (RuntimeError" in caplog.text
    assert model.lookups is not None and not is_batchable(model)
    index = SubmodelIndex.build(dataset)
    schedule = Schedule(
        2,
        3,
        local=LocalWork(2, 3, ClientStep(lr=0.1)),
        seed=4,
        execution=Execution(dtype=torch.float64),
    )
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        assert_backends_match_reference(
            model, algorithm_for("fedavg", dataset, index), dataset, index, schedule
        )
    assert "model TorchModuleModel cannot be batched; running the sequential backend" in (
        caplog.text
    )


def test_an_unused_parameter_is_left_untrained_and_an_unread_table_refused(caplog):
    dataset = two_tables_with_dense(0)
    module = seeded(TwoBags)
    module.spare = nn.Linear(2, 2)  # never called by forward
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        model = wrap(module, dataset)
    assert "does not use parameter(s) spare.weight, spare.bias; fedsub leaves them" in caplog.text
    assert "spare.weight" not in model.init(torch.Generator(), torch.float64).dense
    index = SubmodelIndex.build(dataset)
    trained = assert_backends_match_reference(
        model, algorithm_for("fedavg", dataset, index, 3), dataset, index, small_run(1)
    )
    assert torch.equal(model.to_module(trained["batched"]).spare.weight, module.spare.weight)

    class IgnoresB(TwoBags):
        def forward(self, batch):
            a = self.a(*batch.ids["a"])
            return self.mlp(torch.cat([a, a, batch.dense], dim=-1)).squeeze(-1)

    with pytest.raises(ConfigError, match=r"module 'b' \(table 'b'\) is not used by the"):
        wrap(seeded(IgnoresB), dataset)


def test_dropout_is_inactive_and_said_so(caplog):
    module = seeded(TwoBags)
    module.mlp.insert(1, nn.Dropout(0.5))
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        model = wrap(module, two_tables_with_dense(0))
    assert "module 'mlp.1' is a Dropout: fedsub runs the module in eval mode" in caplog.text
    assert is_batchable(model)
    assert module.training  # the user's module is left as it was


# --- algorithms, privacy, resume, capture -----------------------------------------------------


def small_run(rounds: int = 3, privacy: Privacy | None = None, **execution) -> Schedule:
    """``execution``: the [execution] settings besides the dtype (backend, compile)."""
    on = Execution(dtype=torch.float64, **execution)
    return Schedule(
        rounds,
        3,
        LocalWork(2, 3, ClientStep(0.1)),
        3,
        execution=on,
        settings=(privacy,) if privacy else (),
    )


@pytest.mark.parametrize("name", ["fedavg", "fedsubavg", "scaffold", "fedadam", "fedprox"])
def test_algorithms_agree_across_backends_and_resume(name, tmp_path):
    _, model, dataset = case("two-bags")
    index = SubmodelIndex.build(dataset)

    def algorithm():
        return build_algorithm(name, AlgorithmContext(dataset, index, "samples", 3))

    straight = assert_backends_match_reference(model, algorithm(), dataset, index, small_run())
    done: list[int] = []
    stop = RunControl(checkpoints=tmp_path, stop_requested=lambda: done[-1] >= 1)
    with pytest.raises(Interrupted) as stopped:
        train(model, algorithm(), dataset, index, small_run(), on_round=done.append, control=stop)
    saved = checkpoint_lib.load(stopped.value.checkpoint)
    resumed = train(
        model, algorithm(), dataset, index, small_run(), control=RunControl(resume=saved)
    )
    for key, value in straight["sequential"].state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "privacy",
    [
        Privacy("download", download_keep=0.6, randomness="seeded"),
        Privacy("full", randomness="seeded"),
    ],
    ids=lambda p: p.level,
)
def test_privacy_levels_agree_across_backends(privacy):
    _, model, dataset = case("two-bags")
    index = SubmodelIndex.build(dataset)
    models = {}
    for backend in ("sequential", "batched"):
        algorithm = algorithm_for("fedsubavg", dataset, index, 3)
        schedule = small_run(privacy=privacy, backend=backend)
        models[backend] = train(model, algorithm, dataset, index, schedule)
    start = initial_params(model, small_run()).tables["a"]
    assert not torch.equal(models["sequential"].tables["a"], start)
    for key, value in models["sequential"].state_dict().items():
        torch.testing.assert_close(models["batched"].state_dict()[key], value, rtol=0, atol=1e-9)


def test_rounds_split_across_processes_give_the_one_process_model(monkeypatch):
    """torchrun splits each cohort into contiguous shares (engine/split_cohort.py); a wrapped
    module's member updates do not depend on the other members, so the shares (emulated in
    this process, as tests/test_distributed.py does) give the one-process model."""
    from .test_distributed import assert_same_model, train_split

    _, model, dataset = case("two-bags")
    index = SubmodelIndex.build(dataset)
    args = (model, algorithm_for("scaffold", dataset, index, 3), dataset, index, small_run(2))
    whole = train(*args)
    for world in (2, 3):
        assert_same_model(train_split(monkeypatch, world, *args), whole, 1e-10, 1e-10)


def test_the_captured_step_gives_the_eager_model():
    """execution.compile traces the split step (stubs included) as one graph: dynamo's capture
    with eager kernels (aot_eager) gives the eager batched model."""
    from torch._dynamo.testing import CompileCounterWithBackend

    _, model, dataset = case("user-items")  # nn.Embedding and a bag given offsets[:-1]
    index = SubmodelIndex.build(dataset)
    algorithm = algorithm_for("fedsubavg", dataset, index, 3)
    counter = CompileCounterWithBackend("aot_eager")
    eager = train(model, algorithm, dataset, index, small_run(1))
    captured = train(model, algorithm, dataset, index, small_run(1, compile=Compile(counter)))
    assert counter.frame_count >= 1
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(captured.state_dict()[key], value, rtol=1e-10, atol=1e-12)


# --- FedSubAvg's heat coefficients act on the module's rows ------------------------------------


def test_fedsubavg_scales_the_modules_rows_as_the_built_in_models():
    """The module ``SummedEmbeddingsLR`` computes what the built-in embedding-lr computes;
    started from the same weights, a FedSubAvg round gives the same rows and head. FedAvg's
    rows differ from FedSubAvg's (the heat coefficients changed them), for both models alike."""
    dataset = two_tables_with_dense(0)
    index = SubmodelIndex.build(dataset)
    module = seeded(lambda: SummedEmbeddingsLR({"a": 40, "b": 9}, ["a", "b"], 2))
    wrapped = wrap(module, dataset)
    built_in = EmbeddingLogisticRegression({"a": 40, "b": 9}, 2, fields=("a", "b"))
    start = wrapped.init(torch.Generator(), torch.float64)

    @dataclasses.dataclass(frozen=True)
    class SameStart(EmbeddingLogisticRegression):
        def init(self, generator, dtype):
            dense = {"weight": start.dense["out.weight"][0], "bias": start.dense["out.bias"]}
            return Params(dict(start.tables), dense).clone()

    same = SameStart(**{f.name: getattr(built_in, f.name) for f in dataclasses.fields(built_in)})
    schedule = Schedule(
        1,
        6,
        local=LocalWork(3, 4, ClientStep(lr=0.5)),
        seed=2,
        execution=Execution(dtype=torch.float64),
    )
    rows = {}
    for name in ("fedsubavg", "fedavg"):
        for label, model in (("module", wrapped), ("built-in", same)):
            algorithm = algorithm_for(name, dataset, index, 6)
            rows[name, label] = train(model, algorithm, dataset, index, schedule)
        got, expected = rows[name, "module"], rows[name, "built-in"]
        for t in ("a", "b"):
            torch.testing.assert_close(got.tables[t], expected.tables[t], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got.dense["out.weight"][0], expected.dense["weight"])
    moved = rows["fedsubavg", "module"].tables["a"] - rows["fedavg", "module"].tables["a"]
    assert float(moved.abs().max()) > 1e-3
