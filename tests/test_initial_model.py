"""An in-process run started from a model file fedsub wrote (``fedsub run --initial-model``,
``fedsub.train(initial_model=)``; runs/initial_model.py, the code Flower's ``initial-model``
uses too): round 0's model is the file's (a warm start: the rest starts afresh), a file that
is not the run's model is refused before anything is written, and the file is part of the
run's identity (a resume refuses another or none, takes the same bytes at another path)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fedsub
from fedsub import config as config_lib
from fedsub.cli import main
from fedsub.distributed import Processes
from fedsub.engine.features import assembly
from fedsub.engine.loop import Interrupted
from fedsub.errors import ArgumentError, FedsubError
from fedsub.sharding import initial
from fedsub.sharding.model_file import WrittenModel
from fedsub.sharding.rounds import shard
from fedsub.submodel.params import Params

from .test_distributed import torchrun
from .test_model_capabilities import built
from .test_sharding import BASE, assert_same_models

DATA = {"num_users": 40, "num_items": 30, "mean_samples_per_user": 8}
OPTIONS = {"rounds": 2, "clients_per_round": 6, "local_steps": 2, "batch_size": 4, "lr": 0.2}
CONFIG = {
    "data": {"name": "synthetic-sparse", "seed": 3, **DATA},
    "train": {"algorithms": ["fedsubavg"], "checkpoint_every": 1, **OPTIONS, "rounds": 3},
    "eval": {"every": 1},
}


@pytest.fixture(scope="module")
def data():
    return fedsub.load_dataset("synthetic-sparse", seed=3, **DATA)


@pytest.fixture(scope="module")
def earlier(data):
    """An earlier run from the seeded draw (2 rounds of FedSubAvg)."""
    return fedsub.train("sparse-lr", data, every=1, **OPTIONS)


@pytest.fixture(scope="module")
def trained(earlier, tmp_path_factory) -> Path:
    """The earlier run's model, saved as a user saves ``fedsub.train``'s result."""
    path = tmp_path_factory.mktemp("earlier") / "model.safetensors"
    save_file(earlier.params.state_dict(), str(path))
    return path


def without_seconds(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k != "elapsed"} for e in history]


def test_a_warm_start_is_the_run_whose_round_0_model_is_the_file(
    data, earlier, trained, monkeypatch
):
    """Bit for bit the run whose initial draw is replaced by the file's tensors; its round 0
    evaluates the earlier run's final model; it ends elsewhere than the same rounds from the
    seeded draw."""
    warm = fedsub.train("sparse-lr", data, every=1, initial_model=trained, **OPTIONS)
    start = load_file(trained)

    def from_the_file(model, schedule) -> Params:
        return Params.from_state_dict({n: v.clone() for n, v in start.items()})

    monkeypatch.setattr(assembly, "initial_params", from_the_file)
    expected = fedsub.train("sparse-lr", data, every=1, **OPTIONS)
    monkeypatch.undo()
    assert without_seconds(warm.history) == without_seconds(expected.history)
    for name, value in expected.params.state_dict().items():
        assert torch.equal(warm.params.state_dict()[name], value), name
    assert warm.history[0]["train_loss"] == earlier.history[-1]["train_loss"]
    assert warm.history[0]["round"] == 0  # a warm start, not a resume: rounds 1 and 2 ran
    assert [e["round"] for e in warm.history] == [0, 1, 2]
    assert not torch.equal(warm.params.tables["features"], earlier.params.tables["features"])


def test_every_algorithm_of_a_comparison_starts_from_the_file(data, earlier, trained):
    runs = fedsub.compare(
        "sparse-lr", data, algorithms=["fedavg", "fedsubavg"], initial_model=trained, **OPTIONS
    )
    for name in ("fedavg", "fedsubavg"):
        assert runs[name].history[0]["train_loss"] == earlier.history[-1]["train_loss"], name


def test_host_placed_tables_start_from_the_file_too(data, trained):
    """The file's values land where the run keeps each tensor (tables on the host)."""
    warm = fedsub.train("sparse-lr", data, initial_model=trained, **OPTIONS)
    host = fedsub.train("sparse-lr", data, initial_model=trained, table_placement="host", **OPTIONS)
    assert without_seconds(host.history) == without_seconds(warm.history)


def test_each_process_reads_only_its_rows_of_the_file(tmp_path):
    """A process's share of the drawn model gets its own rows of the file's tables and the
    dense tensors whole; the whole model gets the file, in the model's order of tensors."""
    generator = torch.Generator().manual_seed(0)
    whole = Params(
        {"b": torch.randn(7, 3, generator=generator), "a": torch.randn(5, 2, generator=generator)},
        {"w": torch.randn(4, generator=generator)},
    )
    path = tmp_path / "model.safetensors"
    save_file({n: v + 1.0 for n, v in whole.state_dict().items()}, str(path))
    read = WrittenModel(path).read_into(whole.clone())
    assert list(read.state_dict()) == ["table.b", "table.a", "dense.w"]
    for name, value in whole.state_dict().items():
        assert torch.equal(read.state_dict()[name], value + 1.0), name
    for rank in range(3):
        part = WrittenModel(path).read_into(shard(whole, Processes(rank, 3)))
        expected = shard(Params.from_state_dict(load_file(path)), Processes(rank, 3))
        for name, value in expected.state_dict().items():
            assert torch.equal(part.state_dict()[name], value), (rank, name)


@pytest.mark.parametrize("name", ["din", "embedding-lr", "lstm", "sparse-lr", "torch-module"])
def test_the_check_sees_each_models_tensors_without_drawing_its_tables(name, tmp_path_factory):
    """What a file is checked against: every tensor's name, shape and dtype of the model's
    draw, its ``randn`` tables on the meta device (no memory: a row-sharded process never
    holds them whole), and a draw that cannot run so drawn whole instead."""
    model, _ = built(name, str(tmp_path_factory.getbasetemp()))
    whole = model.init(torch.Generator().manual_seed(5), torch.float64)
    seen = initial.drawn_shapes(
        lambda g: model.init(g, torch.float64), lambda: torch.Generator().manual_seed(5)
    )
    assert list(seen.state_dict()) == list(whole.state_dict())
    for key, value in whole.state_dict().items():
        assert (seen.state_dict()[key].shape, seen.state_dict()[key].dtype) == (
            value.shape,
            value.dtype,
        ), key
    if name in ("embedding-lr", "sparse-lr"):
        assert all(v.is_meta for v in seen.tables.values())

    def through_numpy(generator: torch.Generator) -> Params:  # cannot run on meta tensors
        return Params({"t": torch.from_numpy(torch.randn(3, 2, generator=generator).numpy())}, {})

    drawn = initial.drawn_shapes(through_numpy, lambda: torch.Generator().manual_seed(5))
    assert torch.equal(
        drawn.tables["t"], through_numpy(torch.Generator().manual_seed(5)).tables["t"]
    )


def bad_model_files(folder: Path, good: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """(file, what the error says) for every way a model file can fail to be the model of the
    tensors ``good`` (a table ``table.features`` and dense tensors): written into ``folder``;
    both runtimes' tests use them (tests/test_flower_initial_model.py)."""
    cases = []

    def write(name: str, tensors: dict[str, torch.Tensor], expected: str) -> None:
        save_file(tensors, str(folder / name))
        cases.append((str(folder / name), expected))

    (folder / "text.safetensors").write_text("not a model")
    cases.append((str(folder / "text.safetensors"), "is not a safetensors file"))
    cases.append((str(folder / "absent.safetensors"), "does not exist"))
    cases.append((str(folder), "is not a file"))
    dense = next(n for n in good if n.startswith("dense."))
    missing = {n: v for n, v in good.items() if n != dense}
    write("missing.safetensors", missing, rf"no tensor '{dense}' \(expected float32 of shape")
    write("extra.safetensors", {**good, "dense.extra": torch.zeros(2)}, "'dense.extra' is not")
    rows = good["table.features"]
    shorter = {**good, "table.features": rows[:-1].clone()}
    wrong = rf"'table.features' has shape \({len(rows) - 1}, .*expected \({len(rows)},"
    write("shorter.safetensors", shorter, wrong)
    doubles = {**good, dense: good[dense].double()}
    write("doubles.safetensors", doubles, rf"'{dense}' is float64, expected float32")
    for bad in (math.nan, math.inf):  # a model a diverged run left: refused, not trained from
        spoiled = rows.clone()
        spoiled[-1, 0] = bad
        write(f"{bad}.safetensors", {**good, "table.features": spoiled},
              r"holds NaN or Inf values in tensor\(s\) 'table.features'")  # fmt: skip
    return cases


def test_a_file_that_is_not_the_runs_model_is_refused_naming_the_option(
    data, trained, tmp_path, capsys
):
    """From Python (``initial_model``) and the command line (``--initial-model``), each
    error names the file and what differs; the command line's run folder is never made."""
    config = tmp_path / "run.toml"
    config.write_text(config_lib.to_toml(config_lib.parse(CONFIG)))
    for index, (path, expected) in enumerate(bad_model_files(tmp_path, load_file(trained))):
        with pytest.raises(FedsubError, match=rf"^initial_model = '{path}'.*{expected}"):
            fedsub.train("sparse-lr", data, initial_model=path, **OPTIONS)
        out = tmp_path / f"out{index}"
        argv = ["run", str(config), "--out", str(out), "--initial-model", path, "--quiet"]
        assert main(argv) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"fedsub: error: --initial-model = '{path}'"), error
        assert re.search(expected, error), (expected, error)
        assert not out.exists()  # nothing written


def test_overwriting_the_run_that_holds_the_file_is_refused_before_anything_moves(
    tmp_path, capsys, monkeypatch
):
    """``--out own --overwrite --initial-model own/.../model.safetensors``: the file would go
    with the run it replaces; both the command line and Python say so, and the old run stays."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(config_lib.to_toml(config_lib.parse(CONFIG)))
    assert main(["run", str(config), "--out", "own", "--quiet"]) == 0
    before = sorted(p.name for p in (tmp_path / "own").rglob("*"))
    file = "own/fedsubavg/model.safetensors"
    argv = ["run", str(config), "--out", "own", "--overwrite", "--initial-model", file]
    assert main([*argv, "--quiet"]) == 2
    error = capsys.readouterr().err
    assert "is inside 'own', the run folder that --overwrite replaces" in error, error
    with pytest.raises(FedsubError, match=r"inside 'own', the run folder that overwrite=True"):
        fedsub.run(str(config), out="own", overwrite=True, initial_model=file)
    assert sorted(p.name for p in (tmp_path / "own").rglob("*")) == before


@pytest.mark.parametrize("value", [3, ["model.safetensors"], "", "  ", b"model.safetensors"])
def test_the_python_argument_must_name_a_file(data, value):
    with pytest.raises(ArgumentError, match=r"^initial_model must .*got "):
        fedsub.train("sparse-lr", data, initial_model=value, **OPTIONS)
    with pytest.raises(ArgumentError, match=r"^initial_model must "):
        fedsub.run(CONFIG, initial_model=value)


def test_the_command_line_refuses_an_empty_file_name_and_a_sweep(tmp_path, trained, capsys):
    assert main(["run", "--initial-model", " ", "--out", str(tmp_path / "a")]) == 2
    assert "--initial-model is blank" in capsys.readouterr().err
    argv = ["compare", "--sweep", "train.lr=0.1,0.2", "--initial-model", str(trained)]
    assert main([*argv, "--out", str(tmp_path / "b"), "--quiet"]) == 2
    assert "--initial-model starts one comparison" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def test_the_file_joins_the_run_identity_only_when_given(tmp_path, trained):
    """A run from the draw keeps the hash of its config.toml alone (every existing run
    folder's); with a file, the hash covers the digest of its bytes, and run.json says which
    file it was."""
    plain = fedsub.run(CONFIG, out=tmp_path / "plain").out
    record = json.loads((plain / "run.json").read_text())
    assert record["config_hash"] == _hash((plain / "config.toml").read_text())
    assert "initial_model" not in record
    warm = fedsub.run(CONFIG, out=tmp_path / "warm", initial_model=trained).out
    record = json.loads((warm / "run.json").read_text())
    digest = hashlib.sha256(trained.read_bytes()).hexdigest()
    text = (warm / "config.toml").read_text()
    assert record["config_hash"] == _hash(f"{text}initial-model = 'sha256:{digest}'\n")
    assert record["initial_model"] == {"path": str(trained.resolve()), "sha256": digest}


def test_a_resume_takes_the_same_bytes_and_refuses_another_file_or_none(tmp_path, trained):
    """Stopped after round 1: resumed with none, another file, or (a run from the draw) a
    file, it is refused saying which; the same bytes at another path end as uninterrupted."""
    whole = fedsub.run(CONFIG, out=tmp_path / "whole", initial_model=trained)["fedsubavg"]
    out = tmp_path / "out"
    with pytest.raises(Interrupted):
        fedsub.run(CONFIG, out=out, initial_model=trained, stop_requested=lambda: True)
    other = tmp_path / "other.safetensors"
    save_file({n: v + 0.5 for n, v in load_file(trained).items()}, str(other))
    with pytest.raises(FedsubError, match=r"started from the model file .*resume it with "):
        fedsub.run(CONFIG, out=out, resume=True)
    with pytest.raises(FedsubError, match=rf"^initial_model = '{other}' \(sha256 \w+\) is not"):
        fedsub.run(CONFIG, out=out, resume=True, initial_model=other)
    assert main(["run", "--resume", str(out), "--initial-model", str(other), "--quiet"]) == 2
    moved = tmp_path / "moved.safetensors"
    moved.write_bytes(trained.read_bytes())  # its bytes, not its path, are the run's
    resumed = fedsub.run(CONFIG, out=out, resume=True, initial_model=moved)["fedsubavg"]
    assert without_seconds(resumed.history) == without_seconds(whole.history)
    for name, value in whole.params.state_dict().items():
        assert torch.equal(resumed.params.state_dict()[name], value), name
    drawn = tmp_path / "drawn"
    with pytest.raises(Interrupted):
        fedsub.run(CONFIG, out=drawn, stop_requested=lambda: True)
    with pytest.raises(FedsubError, match="started from the seeded initial draw, not a model"):
        fedsub.run(CONFIG, out=drawn, resume=True, initial_model=trained)
    assert fedsub.run(CONFIG, out=drawn, resume=True)["fedsubavg"].history[-1]["round"] == 3


@pytest.mark.deployment  # 15 s of a torchrun launch: make test-deployment (torchrun process
# groups stay in make test through tests/test_sharding.py and tests/test_reshard.py)
def test_a_row_sharded_run_starts_each_process_from_its_rows_of_the_file(tmp_path):
    """torchrun, 2 processes: each reads its rows of the file; the models are the one
    process's warm start, bit for bit."""
    sharded, alone = tmp_path / "sharded.toml", tmp_path / "alone.toml"
    text = BASE.replace("checkpoint_every = 2", "checkpoint_every = 0")
    sharded.write_text(text)
    alone.write_text(text.replace('table_sharding = "rows"', 'table_sharding = "none"'))
    first, one, two = tmp_path / "first", tmp_path / "one", tmp_path / "two"
    assert main(["run", str(alone), "--algorithm", "fedavg", "--out", str(first), "--quiet"]) == 0
    start = first / "fedavg" / "model.safetensors"
    names = ["fedsubavg", "fedadam-lazy"]
    warm = ["--algorithms", ",".join(names), "--initial-model", str(start), "--quiet"]
    assert main(["compare", str(alone), "--out", str(one), *warm]) == 0
    done = torchrun(tmp_path, "compare", str(sharded), "--out", str(two), *warm)
    assert done.returncode == 0, done.stderr
    assert_same_models(two, one, names)
    final = json.loads((first / "fedavg" / "metrics.jsonl").read_text().splitlines()[-1])
    round_0 = json.loads((two / "fedsubavg" / "metrics.jsonl").read_text().splitlines()[0])
    assert round_0["round"] == 0 and round_0["train_loss"] == final["train_loss"]
