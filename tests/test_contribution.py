"""Features as contributions (engine/contribution.py, engine/features/): the round loop and the
server round name no feature; a feature is an adapter whose typed pieces one assembler folds in
one order. Shown with toy features: one that counts rounds (an after-round hook, a metric, a
checkpoint stage) trains a run bit for bit the plain one's, its stage saved and restored by
name; client stages compose innermost first in the features' order; the folding rules; and the
pairs the assembler never composes are each refused by config.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsub.algorithms.aggregation import RowUpdate, ServerUpdate
from fedsub.config import Config
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.contribution import (
    CohortDraw,
    Combining,
    Feature,
    RoundContribution,
    RoundFeatures,
    RoundHooks,
    RoundSetup,
)
from fedsub.engine.features import assembly
from fedsub.engine.features.assembly import EXCLUSIVE, FEATURES, check_combination
from fedsub.engine.in_process import train
from fedsub.engine.loop import Evaluation, Interrupted, RunControl
from fedsub.engine.server_round import ServerRound
from fedsub.errors import ConfigError

from .conftest import make_dataset
from .equivalence import algorithm_for
from .test_stage_state import CLIENTS, SCHEDULE

SPINE = [
    Path(__file__).parents[1] / "src" / "fedsub" / "engine" / f
    for f in ("loop.py", "server_round.py")
]


@dataclasses.dataclass
class Counter:
    """A toy feature's state: the rounds it saw (a ``Stateful``)."""

    seen: int = 0

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"seen": torch.tensor([self.seen])}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.seen = int(tensors["seen"][0])


def counting(counters: list[Counter]) -> Feature:
    def contribute(setup: RoundSetup) -> RoundContribution:
        counter = Counter()
        counters.append(counter)

        def after(round_index: int) -> None:
            counter.seen += 1

        hooks = RoundHooks(after_round=after, metrics=lambda: {"toy_rounds": counter.seen})
        return RoundContribution("toy", hooks=hooks, stages={"toy": counter}, handle=counter)

    return Feature("toy", contribute)


def run(model, dataset, index, algorithm, **options):
    return train(model, algorithm, dataset, index, SCHEDULE, **options)


def toy_run():
    from fedsub.models.sparse_lr import SparseLogisticRegression
    from fedsub.submodel.index import SubmodelIndex

    dataset = make_dataset(CLIENTS, table_rows=5)
    index = SubmodelIndex.build(dataset)
    algorithm = algorithm_for("fedavg", dataset, index, SCHEDULE.clients_per_round)
    return SparseLogisticRegression(dict(dataset.table_rows)), dataset, index, algorithm


def test_a_new_feature_plugs_in_without_editing_the_loop(tmp_path, monkeypatch):
    from fedsub.engine.evaluate import Evaluator

    model, dataset, index, algorithm = toy_run()
    evaluator = Evaluator.build(model, dataset, 50, seed=0)
    plain = run(model, dataset, index, algorithm)
    counters: list[Counter] = []
    monkeypatch.setattr(assembly, "FEATURES", (*FEATURES, counting(counters)))
    evaluations: list[Evaluation] = []
    watched: list[Counter] = []
    control = RunControl(watch={"toy": watched.append})
    got = run(
        model,
        dataset,
        index,
        algorithm,
        evaluator=evaluator,
        on_evaluation=evaluations.append,
        control=control,
    )
    assert watched == counters[:1]
    assert [e.metrics["toy_rounds"] for e in evaluations] == [e.round for e in evaluations]
    for name, value in plain.state_dict().items():  # the toy feature changes no number
        assert torch.equal(got.state_dict()[name], value), name

    done: list[int] = []
    stop = RunControl(checkpoints=tmp_path, stop_requested=lambda: done[-1] >= 2)
    with pytest.raises(Interrupted) as stopped:
        run(model, dataset, index, algorithm, on_round=done.append, control=stop)
    saved = checkpoint_lib.load(stopped.value.checkpoint)
    assert int(saved.stages["toy"]["seen"][0]) == 2
    resumed = run(model, dataset, index, algorithm, control=RunControl(resume=saved))
    assert counters[-1].seen == SCHEDULE.rounds  # 2 restored, then the rest counted
    for name, value in plain.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_client_stages_compose_innermost_first_in_feature_order(monkeypatch):
    calls: list[str] = []

    def tagging(name: str) -> Feature:
        def stage(inner):
            def run_cohort(job):
                calls.append(f"{name} in")
                update = inner(job)
                calls.append(f"{name} out")
                return update

            return run_cohort

        return Feature(name, lambda setup: RoundContribution(name, client_stage=stage))

    monkeypatch.setattr(assembly, "FEATURES", (tagging("inner"), tagging("outer")))
    model, dataset, index, algorithm = toy_run()
    run(model, dataset, index, algorithm)
    assert calls[:4] == ["outer in", "inner in", "inner out", "outer out"]


def test_the_folding_rules():
    first = ServerUpdate({"w": RowUpdate(torch.tensor([0]), torch.ones(1, 1))}, {})
    second = ServerUpdate({}, {})
    features = RoundFeatures(
        (
            RoundContribution("a", combining=Combining(override=lambda u, r: first)),
            RoundContribution("b", combining=Combining(override=lambda u, r: second)),
            RoundContribution(
                "c", draw=CohortDraw(key=lambda: 42), hooks=RoundHooks(stop_before=lambda r: r > 3)
            ),
        )
    )
    override = features.override()
    assert override is not None and override(None, 1) is first  # the first given wins
    assert features.sampling_key(7) == 42 and RoundFeatures().sampling_key(7) == 7
    assert not features.combines_empty() and [features.stop_before(r) for r in (3, 4)] == [
        False,
        True,
    ]
    twice = RoundFeatures(
        (
            RoundContribution("a", stages={"s": Counter()}),
            RoundContribution("b", stages={"s": Counter()}),
        )
    )
    with pytest.raises(ValueError, match="stage name 's' is taken"):
        twice.stages()
    with pytest.raises(ConfigError, match="'dp' and 'row_sharding'"):
        check_combination(["dp", "torchrun_split", "row_sharding"])


@dataclasses.dataclass
class EveryOther:
    """A toy cohort filter: only clients of parity ``parity`` (or above ``above``), and the
    cohorts it was told of."""

    parity: int | None = None
    above: int = -1
    told: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)

    def eligible(self, round_index: int, among):
        candidates = np.arange(10) if among is None else among
        keep = candidates > self.above
        if self.parity is not None:
            keep &= candidates % 2 == self.parity
        return candidates[keep]

    def record(self, round_index: int, clients) -> None:
        self.told.append((round_index, clients.tolist()))


def test_cohort_filters_narrow_the_draw_in_order_and_are_told_the_cohort():
    """``draw.filter``: each filter narrows the clients in the features' order (none:
    ``among`` as it is), and each is told the cohort drawn."""
    even, high = EveryOther(parity=0), EveryOther(above=5)
    features = RoundFeatures(
        (
            RoundContribution("a", draw=CohortDraw(filter=even)),
            RoundContribution("b"),
            RoundContribution("c", draw=CohortDraw(filter=high)),
        )
    )
    assert RoundFeatures().eligible(3, None) is None
    assert features.eligible(3, None).tolist() == [6, 8]
    assert features.eligible(3, np.array([1, 2, 7, 8])).tolist() == [8]
    features.drawn(3, np.array([8]))
    assert even.told == high.told == [(3, [8])]


def test_the_features_are_asked_in_the_documented_order():
    assert [f.name for f in FEATURES] == [
        "torchrun_split",
        "masking",
        "dp",
        "private_rounds",
        "host_tables",
        "row_sharding",
        "heat_secret",
    ]


KEYS = {
    "masking": ["model.name='mlp'", "masking.scheme='static'"],
    "private_rounds": ["privacy.level='download'"],
    "dp": ["dp.mechanism='gaussian'", "dp.noise_multiplier=1.0"],
    "host_tables": ["execution.table_placement='host'"],
    "row_sharding": ["execution.table_sharding='rows'"],
}


@pytest.mark.parametrize("pair", [p for p in EXCLUSIVE if set(p) <= set(KEYS)], ids=str)
def test_config_refuses_each_pair_the_assembler_never_composes(pair):
    first, second = pair
    Config.from_toml(None, KEYS[first])  # each alone is fine
    Config.from_toml(None, KEYS[second])
    with pytest.raises(ConfigError, match="cannot"):
        Config.from_toml(None, [*KEYS[first], *KEYS[second]])


def names_a_feature(identifier: str) -> bool:
    """Whether an identifier names [dp], sharding, masking or the private rounds (its words:
    ``dp_streams``, ``ShardedTables``, ``masking``, ``PrivateRounds``)."""
    words = [w.lower() for w in re.split(r"_|(?<=[a-z])(?=[A-Z])", identifier) if w]
    return any(w == "dp" or w.startswith(("shard", "mask", "private")) for w in words)


def test_the_spine_names_no_feature():
    """engine/loop.py and engine/server_round.py: no feature's name in their code (comments
    and docstrings aside), no import of a feature's package."""
    import ast
    import io
    import tokenize

    assert names_a_feature("dp_streams") and names_a_feature("ShardedTables")
    assert names_a_feature("PrivateRounds") and not names_a_feature("RoundPlan")
    for path in SPINE:
        source = path.read_text()
        code = [
            t.string
            for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type == tokenize.NAME
        ]
        named = [n for n in code if names_a_feature(n)]
        assert not named, f"{path.name} names {sorted(set(named))}"
        imported = [
            node.module
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module
        ]
        assert not [
            m
            for m in imported
            if m.split(".")[1:2] in (["dp"], ["sharding"], ["masking"], ["privacy"])
        ]


@pytest.mark.parametrize("level", ["none", "heat", "download", "full"])
def test_the_private_rounds_build_the_combine_and_override_nothing(level):
    """The private rounds' feature overrides no combine at any level: it builds the round's
    combine (so a runtime's own combine, the clock's FedBuff, replaces it without an override
    of its own, and a DP mechanism's override wins); that the model at level none is the plain
    run's is test_private_rounds.py's."""
    from fedsub.engine.features import private
    from fedsub.engine.initial import initial_params
    from fedsub.privacy.levels import Privacy

    model, dataset, _, algorithm = toy_run()
    schedule = SCHEDULE.with_setting(Privacy, Privacy(level))
    params = initial_params(model, schedule)
    setup = RoundSetup(model, algorithm, schedule, dataset.sample_counts(), params)
    contribution = private.contribute(setup)
    assert contribution is not None and contribution.name == private.NAME
    assert contribution.combining.override is None and contribution.combining.combine is not None
    assert RoundFeatures((contribution,)).override() is None


def test_no_module_but_the_server_round_assigns_a_server_rounds_fields():
    """A runtime wrapped around the rounds (the virtual clock) takes part through
    ``ServerRound.wrapped`` / ``repopulate``, never by setting the round's fields: every
    assignment to ``<x>.<field>`` where ``x`` is a name the code gives a ``ServerRound``
    (``rounds``, ``server_round``) lives in engine/server_round.py."""
    import ast

    source = Path(__file__).parents[1] / "src" / "fedsub"
    fields = {f.name for f in dataclasses.fields(ServerRound)}
    found = []
    for path in source.rglob("*.py"):
        if path.name == "server_round.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in ("rounds", "server_round")
                    and target.attr in fields
                ):
                    found.append(f"{path.relative_to(source)}:{node.lineno}")
    assert not found, found
