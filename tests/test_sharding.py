"""Row-sharded tables (``execution.table_sharding = "rows"``, fedsub/sharding).

In one process: the partition of a table's rows, the one-file model writer, and what is
refused (with its reason). With real processes (``torchrun --nproc-per-node 2``, gloo): the
sharded FedAvg, FedSubAvg and FedAdam-lazy models are bit for bit one process's, checkpoints
hold one folder per shard, a sharded run stopped after its checkpoint and resumed ends with
the same models, and a resume by another number of processes is refused naming the number.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fedsub
from fedsub import cli
from fedsub import config as config_lib
from fedsub.distributed import Processes
from fedsub.engine import evaluate, in_process
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.execution import Execution
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.errors import ConfigError
from fedsub.sharding import evaluation as sharded_evaluation
from fedsub.sharding import initial
from fedsub.sharding.evaluation import ShardedScoring
from fedsub.sharding.model_file import write_model
from fedsub.sharding.partition import RowPartition
from fedsub.sharding.rounds import shard
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params

from .equivalence import algorithm_for
from .test_backends import DATASETS, model_for
from .test_distributed import files_of, torchrun
from .test_model_capabilities import built


@pytest.mark.parametrize("rows", [0, 1, 5, 7, 100])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_row_has_one_owner_and_the_ranges_are_the_table_in_rank_order(rows, world):
    partition = RowPartition(rows, world)
    ranges = [partition.range_of(r) for r in range(world)]
    assert [row for part in ranges for row in part] == list(range(rows))
    ids = torch.arange(rows)
    owners = partition.owners(ids)
    for rank, part in enumerate(ranges):
        mine = ids[owners == rank]
        assert mine.tolist() == list(part)
        assert partition.local(mine, rank).tolist() == list(range(len(part)))


def test_one_process_shard_writes_the_model_a_safetensors_reader_loads(tmp_path):
    whole = Params(
        {"a": torch.randn(7, 3, dtype=torch.float64), "b": torch.randn(2, 5)},
        {"w": torch.randn(4), "bias": torch.zeros(1)},
    )
    part = shard(whole, Processes(0, 1))
    write_model(tmp_path / "model.safetensors", part)
    loaded = load_file(tmp_path / "model.safetensors")
    assert loaded.keys() == whole.state_dict().keys()
    for name, tensor in whole.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    assert files_of(tmp_path) == {"model.safetensors"}  # no temporary file left


def test_the_shards_of_a_model_are_its_row_ranges():
    whole = Params({"t": torch.arange(10.0).reshape(5, 2)}, {"d": torch.ones(2)})
    parts = [shard(whole, Processes(r, 2)) for r in range(2)]
    assert [p.tables["t"][:, 0].tolist() for p in parts] == [[0.0, 2.0, 4.0], [6.0, 8.0]]
    assert all(torch.equal(p.dense["d"], whole.dense["d"]) for p in parts)


def test_one_process_is_refused_naming_torchrun():
    dataset = DATASETS["synthetic"]()
    index = SubmodelIndex.build(dataset)
    schedule = Schedule(
        1, 4, LocalWork(1, 2, ClientStep(0.1)), seed=1, execution=Execution(table_sharding="rows")
    )
    algorithm = algorithm_for("fedavg", dataset, index)
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node P"):
        in_process.train(model_for(dataset), algorithm, dataset, index, schedule)


BASE = """
[data]
name = "synthetic-sparse"
num_users = 30
num_items = 20
mean_samples_per_user = 6

[model]
name = "embedding-lr"
embedding_dim = 4

[train]
algorithms = ["fedavg", "fedsubavg", "fedadam-lazy"]
rounds = 4
clients_per_round = 5
local_steps = 2
batch_size = 4
lr = 0.2
checkpoint_every = 2

[execution]
deterministic = true
backend = "sequential"
table_sharding = "rows"
"""


@pytest.mark.parametrize(
    "section,change,reason",
    [
        ("train", {"algorithms": ["scaffold"]}, "control variates"),
        ("train", {"algorithms": ["fedadam"]}, "updates every row every round"),
        ("train", {"algorithms": ["fedavg@scheme2"]}, "averages models"),
        ("privacy", {"level": "download"}, "privacy.level"),
        ("execution", {"table_placement": "host"}, "table_placement"),
        ("eval", {"gradient_norms": True}, "reads whole tables"),
    ],
)
def test_what_is_not_row_local_or_needs_a_whole_table_is_refused_with_the_reason(
    section, change, reason
):
    raw = tomllib.loads(BASE)
    raw.setdefault(section, {}).update(change)
    with pytest.raises(ConfigError, match=reason) as error:
        config_lib.parse(raw)
    assert 'execution.table_sharding = "rows"' in str(error.value)


def assert_same_models(got: Path, expected: Path, names: list[str]) -> None:
    """The same model files, and the same evaluations (all but the training seconds)."""
    for name in names:
        a = load_file(got / name / "model.safetensors")
        b = load_file(expected / name / "model.safetensors")
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name} {key}"
        metrics = [
            [{k: v for k, v in json.loads(line).items() if k != "elapsed"} for line in lines]
            for lines in (
                (folder / name / "metrics.jsonl").read_text().splitlines()
                for folder in (got, expected)
            )
        ]
        assert metrics[0] == metrics[1], name


def test_sharded_runs_train_one_process_models_and_resume_with_their_processes(tmp_path, capsys):
    sharded, alone = tmp_path / "sharded.toml", tmp_path / "alone.toml"
    sharded.write_text(BASE)
    alone.write_text(BASE.replace('table_sharding = "rows"', 'table_sharding = "none"'))
    one, two = tmp_path / "one", tmp_path / "two"
    names = ["fedavg", "fedsubavg", "fedadam-lazy"]
    assert cli.main(["compare", str(alone), "--out", str(one), "--quiet"]) == 0
    done = torchrun(tmp_path, "compare", str(sharded), "--out", str(two), "--quiet")
    assert done.returncode == 0, done.stderr
    assert_same_models(two, one, names)
    round_2 = two / "fedsubavg" / "checkpoints" / "round-000002"
    assert {p.name for p in round_2.iterdir()} == {"state.json", "shard-0-of-2", "shard-1-of-2"}

    # killed after its round-2 checkpoint: fedsubavg resumes from its shards
    (two / "fedsubavg" / "done").unlink()
    (two / "fedsubavg" / "model.safetensors").unlink()
    capsys.readouterr()
    assert cli.main(["compare", "--resume", str(two), "--quiet"]) != 0  # one process
    error = capsys.readouterr().err
    assert "sharded over 2 processes" in error and "torchrun --nproc-per-node 2" in error
    resumed = torchrun(tmp_path, "compare", "--resume", str(two), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert_same_models(two, one, names)


@pytest.mark.parametrize("name", ["din", "embedding-lr", "lstm", "sparse-lr", "torch-module"])
@pytest.mark.parametrize("world", [2, 3])
def test_each_process_draws_its_rows_of_the_one_process_initial_model(
    name, world, monkeypatch, tmp_path_factory
):
    """Drawn in chunks of a few rows (CHUNK_VALUES made tiny), each shard is its rows of the
    whole draw, and the dense parameters drawn after the tables are too: the generator ended
    where the whole draw leaves it."""
    model, _ = built(name, str(tmp_path_factory.getbasetemp()))
    monkeypatch.setattr(initial, "CHUNK_VALUES", 16)
    for dtype in (torch.float32, torch.float64):
        whole = model.init(torch.Generator().manual_seed(5), dtype)
        for rank in range(world):
            part = initial.sharded_init(
                lambda g, dtype=dtype: model.init(g, dtype),
                lambda: torch.Generator().manual_seed(5),
                Processes(rank, world),
            )
            expected = shard(whole, Processes(rank, world))
            assert part.partitions == expected.partitions
            for key, value in expected.state_dict().items():
                assert torch.equal(part.state_dict()[key], value), (name, rank, key)


def test_a_table_drawn_in_chunks_is_the_whole_draw_and_leaves_the_generator_there():
    for rows, dim in [(1001, 3), (37, 16), (40, 1), (9, 5)]:
        for keep in [range(0, rows), range(5, rows // 2), range(rows - 1, rows)]:
            whole_g, part_g = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
            whole = torch.randn(rows, dim, generator=whole_g)
            old = initial.CHUNK_VALUES
            initial.CHUNK_VALUES = 16
            try:
                part = initial.rows_of_randn((rows, dim), keep, {"generator": part_g})
            finally:
                initial.CHUNK_VALUES = old
            assert torch.equal(part, whole[keep.start : keep.stop])
            assert torch.equal(torch.rand(4, generator=part_g), torch.rand(4, generator=whole_g))


class RowsOfTheWholeModel:
    """A stand-in for process ``rank``'s ShardedTables in one process: every fetched row comes
    from the whole model (what its owners send); counts the rows fetched."""

    def __init__(self, whole: Params, rank: int, world: int) -> None:
        self.whole, self.processes, self.fetched = whole, Processes(rank, world), 0

    def fetch(self, _params, table, rows, _what):
        self.fetched += len(rows)
        return self.whole.tables[table].index_select(0, rows)


@pytest.mark.parametrize("world", [2, 3])
def test_each_process_scores_its_share_of_the_chunks_and_the_metrics_are_one_process(
    world, monkeypatch
):
    dataset = DATASETS["two-tables-dense"]()
    model = model_for(dataset)
    drawn = model.init(torch.Generator().manual_seed(0), torch.float64)
    torch.manual_seed(0)  # every parameter random (the initial head is zero: outputs would be)
    whole = Params(
        {t: torch.randn_like(v) for t, v in drawn.tables.items()},
        {n: torch.randn_like(v) for n, v in drawn.dense.items()},
    )
    monkeypatch.setattr(evaluate, "CHUNK", 7)  # several chunks per set
    evaluator = Evaluator.build(model, dataset, 40, seed=1)
    expected = evaluator.evaluate(whole)
    stand_ins = [RowsOfTheWholeModel(whole, rank, world) for rank in range(world)]

    def outputs_of(params, samples):
        parts = []
        for stand_in in stand_ins:  # each process's outputs, gathered in rank order
            scoring = ShardedScoring(stand_in, model, evaluate.eval_chunks)
            with monkeypatch.context() as patch:
                patch.setattr(sharded_evaluation.distributed, "all_gather", lambda v, _: [v])
                parts.append(scoring(params, samples))
        return torch.cat(parts)

    sharded = dataclasses.replace(evaluator, outputs_of=outputs_of, batches={})
    assert sharded.evaluate(whole) == expected
    for samples in (evaluator.train_subset, evaluator.test):
        assert torch.equal(sharded.outputs(whole, samples), evaluator.outputs(whole, samples))
    union = sum(len(set(ragged.values)) for ragged in dataset.test.ids.values())
    assert all(s.fetched > 0 for s in stand_ins)
    assert max(s.fetched for s in stand_ins) < union + 40 * len(dataset.table_rows)


LIBRARY_RUN = """
import json, os, sys, tomllib
from pathlib import Path

import fedsub
from safetensors.torch import save_file

config, out = Path(sys.argv[1]), Path(sys.argv[2])
rank = os.environ["RANK"]
ran = fedsub.run(tomllib.loads(config.read_text()), out=out / "run")
trained = fedsub.train(table_sharding="rows", **json.loads(sys.argv[3]))
for name, result in (("run", ran["fedsubavg"]), ("train", trained)):
    save_file(result.params.state_dict(), str(out / f"{name}-{rank}.safetensors"))
    (out / f"{name}-{rank}.txt").write_text(str(result.model_file))
"""


def test_every_process_s_result_reads_the_trained_model_and_every_rejection_is_logged(tmp_path):
    """Under torchrun with row-sharded tables, ``fedsub.run`` (a run folder) and
    ``fedsub.train`` (none: a temporary file, gone when the processes exit) give every process a
    result whose ``params`` are the one-process model's; the members rejected by the
    screening (``max_update_norm``; some trained by process 1, a round where all are) are
    logged in member order, as one process logs them."""
    raw = tomllib.loads(BASE)
    raw["train"].update(algorithms=["fedsubavg"], max_update_norm=0.08, checkpoint_every=0)
    sharded = tmp_path / "sharded.toml"
    sharded.write_text(config_lib.to_toml(config_lib.parse(raw)))
    raw["execution"]["table_sharding"] = "none"
    one = fedsub.run(raw, out=tmp_path / "one")["fedsubavg"]
    options = {
        "model": "embedding-lr",
        "data": "synthetic-sparse",
        "algorithm": "fedsubavg",
        "model_options": {"embedding_dim": 4},
        **{
            k: raw["train"][k]
            for k in ("rounds", "clients_per_round", "local_steps", "batch_size", "lr")
        },
        "max_update_norm": 0.08,
        "deterministic": True,
        "backend": "sequential",
    }
    alone_trained = fedsub.train(**options)
    script = tmp_path / "library_run.py"
    script.write_text(LIBRARY_RUN)
    env = {**os.environ, "PYTHONPATH": str(Path(fedsub.__file__).parents[1])}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    arguments = [str(script), str(sharded), str(tmp_path), json.dumps(options)]
    done = subprocess.run(
        [*launcher, "--nproc-per-node", "2", *arguments],
        cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    model_file = tmp_path / "run" / "fedsubavg" / "model.safetensors"
    for rank in (0, 1):
        ran = load_file(tmp_path / f"run-{rank}.safetensors")
        assert (tmp_path / f"run-{rank}.txt").read_text() == str(model_file)
        trained = load_file(tmp_path / f"train-{rank}.safetensors")
        temporary = Path((tmp_path / f"train-{rank}.txt").read_text())
        assert temporary.name == f"model-{rank}.safetensors"
        assert not temporary.parent.exists()  # each process removed its link, the last the folder
        for got, expected in ((ran, one.params), (trained, alone_trained.params)):
            assert got.keys() == expected.state_dict().keys()
            for key, value in expected.state_dict().items():
                assert torch.equal(got[key], value), (rank, key)
    logged = (tmp_path / "run" / "fedsubavg" / "rejections.jsonl").read_text()
    assert logged == (tmp_path / "one" / "fedsubavg" / "rejections.jsonl").read_text()
    assert len(logged.splitlines()) >= 5
