"""Re-sharding a row-sharded run's checkpoints for another number of processes
(``fedsub reshard RUN_FOLDER --processes P``, engine/reshard.py).

With real processes: a run sharded over 2 processes (torchrun, gloo), stopped after its round-2
checkpoint, re-sharded for 3 and resumed by 3 processes ends with the one-process models bit
for bit; the re-sharded tensors are the originals concatenated in rank order and cut again
(checked here by slicing, with the range sizes written out). By hand-written checkpoints: what
is refused (damaged, incomplete, replicated tensors that differ) names the file or tensor.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedsub import cli
from fedsub.engine.reshard import owner_table, reshard, reshard_folder
from fedsub.errors import FedsubError
from fedsub.files.tensor_files import write_tensors

from .test_distributed import files_of, torchrun
from .test_sharding import BASE, assert_same_models

NAMES = ["fedsubavg", "fedadam-lazy"]  # with and without per-row server state (lazy moments)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """A run sharded over 2 processes and the same run in one process (both finished)."""
    tmp = tmp_path_factory.mktemp("reshard")
    config = BASE.replace('"fedavg", "fedsubavg", "fedadam-lazy"', '"fedsubavg", "fedadam-lazy"')
    (tmp / "sharded.toml").write_text(config)
    (tmp / "alone.toml").write_text(config.replace('= "rows"', '= "none"'))
    one, two = tmp / "one", tmp / "two"
    assert cli.main(["compare", str(tmp / "alone.toml"), "--out", str(one), "--quiet"]) == 0
    done = torchrun(tmp, "compare", str(tmp / "sharded.toml"), "--out", str(two), "--quiet")
    assert done.returncode == 0, done.stderr
    return one, two


def shard_tensors(checkpoint: Path, processes: int) -> list[dict[str, torch.Tensor]]:
    """Each shard's tensors, ``<stage>/<name>`` -> tensor, in rank order."""
    return [
        {
            f"{f.stem}/{k}": v
            for f in sorted((checkpoint / f"shard-{r}-of-{processes}").glob("*.safetensors"))
            for k, v in load_file(f).items()
        }
        for r in range(processes)
    ]


ROW_CUT = {"model/table.features", "server/adam.lazy.m.features", "server/adam.lazy.v.features"}


def test_a_run_resharded_from_2_to_3_processes_resumes_to_the_one_process_models(runs, tmp_path):
    one, original = runs
    two = tmp_path / "run"
    shutil.copytree(original, two)
    for name in NAMES:  # killed after its round-2 checkpoint
        (two / name / "done").unlink()
        (two / name / "model.safetensors").unlink()
    before = {n: shard_tensors(two / n / "checkpoints" / "round-000002", 2) for n in NAMES}
    assert cli.main(["reshard", str(two), "--processes", "3", "--quiet"]) == 0

    for name in NAMES:
        folder = two / name / "checkpoints" / "round-000002"
        assert {p.name for p in folder.iterdir()} == {
            "state.json", "shard-0-of-3", "shard-1-of-3", "shard-2-of-3"
        }  # fmt: skip
        assert json.loads((folder / "state.json").read_text())["shards"] == 3
        old, new = before[name], shard_tensors(folder, 3)
        assert all(s.keys() == old[0].keys() for s in new)
        assert ROW_CUT & old[0].keys()
        for key in old[0]:
            if key not in ROW_CUT:  # replicated: each new shard holds the same tensor
                assert all(torch.equal(s[key], old[0][key]) for s in new), (name, key)
                continue
            whole = torch.cat([old[0][key], old[1][key]])
            assert len(whole) == 209  # 20 items + the synthetic users' feature rows
            sizes = [70, 70, 69]  # 209 rows over 3: the first 209 mod 3 = 2 take one more
            assert [len(s[key]) for s in new] == sizes, (name, key)
            assert torch.equal(new[0][key], whole[0:70]), (name, key)
            assert torch.equal(new[1][key], whole[70:140]), (name, key)
            assert torch.equal(new[2][key], whole[140:209]), (name, key)

    resumed = torchrun(tmp_path, "compare", "--resume", str(two), processes=3)
    assert resumed.returncode == 0, resumed.stderr
    for name in NAMES:  # from the re-sharded checkpoint, not from round 1
        assert f"resume: {name} continues after round 2" in resumed.stderr
    assert "skipping" not in resumed.stderr
    assert_same_models(two, one, NAMES)


def digest(folder: Path) -> dict[str, str]:
    return {
        f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in sorted(files_of(folder))
    }


def test_resharding_a_checkpoint_reads_the_source_only_and_back_to_2_is_the_source(runs, tmp_path):
    source = runs[1] / "fedadam-lazy" / "checkpoints" / "round-000002"
    unchanged = digest(source)
    three, back = tmp_path / "three", tmp_path / "back"
    reshard(source, three, 3)
    reshard(three, back, 2)
    assert digest(source) == unchanged
    for got, expected in zip(shard_tensors(back, 2), shard_tensors(source, 2), strict=True):
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in got)
    with pytest.raises(FedsubError, match="exists"):
        reshard(source, three, 4)


def error_of(capsys, *args: str) -> str:
    capsys.readouterr()
    assert cli.main(["reshard", *args]) == 2
    return capsys.readouterr().err


def test_bad_inputs_are_refused_naming_the_argument(runs, tmp_path, capsys):
    one, two = runs
    assert "--processes 0" in error_of(capsys, str(two), "--processes", "0")
    assert "--processes 1" in error_of(capsys, str(two), "--processes", "1")
    assert "not a run folder" in error_of(capsys, str(tmp_path), "--processes", "3")
    missing = tmp_path / "missing"
    absent = error_of(capsys, str(missing), "--processes", "3")
    assert f"RUN_FOLDER {missing}: not a folder" in absent
    unsharded = error_of(capsys, str(one), "--processes", "3")
    assert "no intact sharded checkpoint" in unsharded and str(one) in unsharded
    with pytest.raises(SystemExit):
        cli.main(["reshard", str(two)])  # --processes is required
    assert "--processes" in capsys.readouterr().err


def hand_written(folder: Path, dense_1: torch.Tensor | None = None) -> Path:
    """A checkpoint of a 5-row table sharded over 2 (rows 0-2, 3-4) with a dense tensor,
    per-row server state and a replicated server count; ``dense_1``: shard 1's dense."""
    table, m = torch.arange(10.0).reshape(5, 2), torch.arange(10.0, 20.0).reshape(5, 2)
    dense = torch.tensor([1.0, 2.0])
    for rank, rows in enumerate([slice(0, 3), slice(3, 5)]):
        shard = folder / f"shard-{rank}-of-2"
        shard.mkdir(parents=True)
        own = dense if dense_1 is None or rank == 0 else dense_1
        write_tensors(shard / "model.safetensors", {"table.t": table[rows], "dense.w": own})
        server = {"adam.lazy.m.t": m[rows], "adam.lazy.m.w": own, "steps": torch.tensor([4])}
        write_tensors(shard / "server.safetensors", server)
    state = {"format": 2, "stages": ["model", "server"], "round": 2, "elapsed": 0.0}
    (folder / "state.json").write_text(json.dumps({**state, "history": [], "shards": 2}))
    return folder


def test_a_hand_written_checkpoint_is_cut_by_rows_and_its_replicated_tensors_copied(tmp_path):
    out = reshard(hand_written(tmp_path / "src"), tmp_path / "out", 3)
    shards = shard_tensors(out, 3)
    table, m = torch.arange(10.0).reshape(5, 2), torch.arange(10.0, 20.0).reshape(5, 2)
    for shard, rows in zip(shards, [slice(0, 2), slice(2, 4), slice(4, 5)], strict=True):
        assert torch.equal(shard["model/table.t"], table[rows])
        assert torch.equal(shard["server/adam.lazy.m.t"], m[rows])
        assert torch.equal(shard["model/dense.w"], torch.tensor([1.0, 2.0]))
        assert torch.equal(shard["server/adam.lazy.m.w"], torch.tensor([1.0, 2.0]))
        assert torch.equal(shard["server/steps"], torch.tensor([4]))


DAMAGES = {
    "server.safetensors: missing": lambda f: (f / "shard-1-of-2/server.safetensors").unlink(),
    "model.safetensors: not a readable": lambda f: (
        f / "shard-0-of-2/model.safetensors"
    ).write_bytes(b"xx"),
    "state.json: not a readable": lambda f: (f / "state.json").write_text("{"),
    "shard-1-of-2/model.safetensors: missing": lambda f: shutil.rmtree(f / "shard-1-of-2"),
}


@pytest.mark.parametrize("message", DAMAGES)
def test_a_damaged_or_incomplete_checkpoint_is_refused_naming_the_file(tmp_path, message):
    source = hand_written(tmp_path / "src")
    DAMAGES[message](source)
    with pytest.raises(FedsubError, match=re.escape(message)):
        reshard(source, tmp_path / "out", 3)
    assert {p.name for p in tmp_path.iterdir()} == {"src"}  # nothing half-written


def test_replicated_tensors_that_differ_between_shards_are_refused_naming_them(tmp_path):
    source = hand_written(tmp_path / "src", dense_1=torch.tensor([1.0, 3.0]))
    with pytest.raises(FedsubError, match=r"'dense\.w': replicated, but shard 1 differs"):
        reshard(source, tmp_path / "out", 3)


def test_every_intact_checkpoint_of_a_folder_is_resharded_and_a_damaged_one_left(tmp_path):
    folder = tmp_path / "checkpoints"
    hand_written(folder / "round-000002")
    damaged = hand_written(folder / "round-000004")
    (damaged / "shard-1-of-2" / "model.safetensors").unlink()
    assert reshard_folder(folder, 3) == [folder / "round-000002"]
    assert {p.name for p in (folder / "round-000002").iterdir()} == {
        "state.json", "shard-0-of-3", "shard-1-of-3", "shard-2-of-3"
    }  # fmt: skip
    assert {p.name for p in damaged.iterdir()} == {"state.json", "shard-0-of-2", "shard-1-of-2"}
    assert {p.name for p in folder.iterdir()} == {"round-000002", "round-000004"}  # no temp


@pytest.mark.parametrize(
    "stage,name,owner",
    [
        ("model", "table.t", "t"),
        ("model", "dense.t", None),  # a dense tensor may share a table's name in the model
        ("server", "adam.lazy.m.t", "t"),
        ("server", "adam.lazy.v.head.t", None),  # dense "head.t", not table "t"
        ("server", "adam.lazy.m.w", None),
        ("server", "steps", None),
        ("server", "t", "t"),
        ("server", "adam.lazy.m.xt", None),  # "xt" is no table: only whole names count
    ],
)
def test_a_tensor_is_cut_by_the_rows_of_the_table_it_is_named_after(stage, name, owner):
    assert owner_table(stage, name, {"t": 5}, {"w", "head.t"}) == owner


def test_a_name_that_is_a_table_and_a_dense_tensor_is_refused():
    with pytest.raises(FedsubError, match="names both a table and a dense one"):
        owner_table("server", "adam.lazy.m.t", {"t": 5}, {"t"})
