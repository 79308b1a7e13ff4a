"""A run owns its output folder: refusal of a used folder, --overwrite, resume that checks
every piece it reads back, damaged checkpoints, file modes, resolved data paths, sweeps."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

from fedsub import config as config_lib
from fedsub.cli import main
from fedsub.engine.loop import Interrupted
from fedsub.errors import FedsubError
from fedsub.runs.experiment import compare, sweep

from .conftest import TINY_COMPARISON

TINY = (
    TINY_COMPARISON
    + """checkpoint_every = 1

[eval]
every = 1
train_loss_samples = 100
target_train_loss = 0.69
"""
)


@pytest.fixture
def tiny(tmp_path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


def results(out: Path) -> dict:
    """What must not depend on interruptions: metrics (elapsed aside), models, summary."""
    found = {"summary": json.loads((out / "summary.json").read_text())}
    for name in ("fedavg", "fedsubavg"):
        lines = (out / name / "metrics.jsonl").read_text().splitlines()
        found[name] = [{k: v for k, v in json.loads(x).items() if k != "elapsed"} for x in lines]
        found[f"{name}/model"] = (out / name / "model.safetensors").read_bytes()
    return found


def stop_after(calls: int):
    """A stop request that comes after ``calls`` rounds (over all algorithms)."""
    rounds: list = []
    return (lambda name, r: rounds.append((name, r))), (lambda: len(rounds) >= calls)


def interrupted(config, out: Path, calls: int) -> Interrupted:
    on_round, stop = stop_after(calls)
    with pytest.raises(Interrupted) as stopped:
        compare(config, out, on_round, stop_requested=stop)
    return stopped.value


def test_a_used_folder_is_refused_and_overwrite_replaces_only_the_run(tmp_path, tiny, capsys):
    out = tmp_path / "out"
    assert main(["compare", str(tiny), "--out", str(out), "--quiet"]) == 0
    first = json.loads((out / "run.json").read_text())
    (out / "notes.txt").write_text("mine")
    argv = ["compare", str(tiny), "--out", str(out), "--quiet", "--set", "train.lr=0.3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"output folder {out} already holds a run" in err
    assert "--overwrite" in err and f"--resume {out}" in err
    assert json.loads((out / "run.json").read_text()) == first  # untouched
    assert main([*argv, "--overwrite"]) == 0
    second = json.loads((out / "run.json").read_text())
    assert second["run_id"] != first["run_id"] and second["config_hash"] != first["config_hash"]
    assert "lr = 0.3" in (out / "config.toml").read_text()
    assert (out / "notes.txt").read_text() == "mine"  # not fedsub's: kept


def test_the_default_folder_is_refused_too(tmp_path, tiny, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(tiny), "--algorithm", "fedavg", "--quiet"]) == 0
    assert main(["run", str(tiny), "--algorithm", "fedsubavg", "--quiet"]) == 2
    assert "output folder runs/latest already holds a run" in capsys.readouterr().err


def test_resume_refuses_a_finished_algorithm_of_another_run(tmp_path, tiny):
    """The reported bug: a reused folder's earlier, different run was read back."""
    config = config_lib.load(tiny)
    other = config_lib.load(tiny, ["train.lr=0.5"])
    compare(other, tmp_path / "other")
    out = tmp_path / "out"
    interrupted(config, out, calls=5)  # fedavg finished, fedsubavg stopped at round 1
    shutil.rmtree(out / "fedavg")
    shutil.copytree(tmp_path / "other" / "fedavg", out / "fedavg")
    with pytest.raises(
        FedsubError, match=re.escape(f"{out / 'fedavg' / 'done'} belongs to another run")
    ):
        compare(config, out, resume=True)


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, tiny):
    config = config_lib.load(tiny)
    interrupted(config, tmp_path / "a", calls=2)
    interrupted(config, tmp_path / "b", calls=2)  # same config, another run id
    shutil.rmtree(tmp_path / "a" / "fedavg" / "checkpoints")
    shutil.copytree(tmp_path / "b" / "fedavg" / "checkpoints", tmp_path / "a/fedavg/checkpoints")
    with pytest.raises(FedsubError, match=re.escape("round-000002 belongs to another run")):
        compare(config, tmp_path / "a", resume=True)


def test_resume_refuses_edited_metrics_config_and_folders_without_run_file(tmp_path, tiny):
    config = config_lib.load(tiny)
    out = tmp_path / "out"
    interrupted(config, out, calls=5)
    metrics = out / "fedavg" / "metrics.jsonl"
    metrics.write_text(metrics.read_text().replace("0.", "1.", 1))
    with pytest.raises(FedsubError, match=re.escape(f"{metrics} is not the file run")):
        compare(config, out, resume=True)
    with pytest.raises(FedsubError, match=re.escape(f"is not the one in {out / 'config.toml'}")):
        compare(config_lib.load(tiny, ["train.lr=0.3"]), out, resume=True)  # another config
    written = (out / "config.toml").read_text()
    (out / "config.toml").write_text(written.replace("lr = ", "lr = 1", 1))  # edited by hand
    with pytest.raises(
        FedsubError, match=re.escape("is not the config its run.json was started with")
    ):
        compare(config, out, resume=True)
    (out / "config.toml").write_text(written)
    (out / "run.json").unlink()
    with pytest.raises(FedsubError, match=re.escape("has no run.json")):
        compare(config, out, resume=True)


@pytest.mark.parametrize("damage", ["truncated tensors", "bad state.json"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one(tmp_path, tiny, damage, caplog):
    config = config_lib.load(tiny)
    compare(config, tmp_path / "straight")
    out = tmp_path / "out"
    interrupted(config, out, calls=3)  # fedavg checkpoints at rounds 2 and 3
    newest = out / "fedavg" / "checkpoints" / "round-000003"
    if damage == "truncated tensors":
        tensors = newest / "model.safetensors"
        tensors.write_bytes(tensors.read_bytes()[:40])
    else:
        (newest / "state.json").write_text('{"format": 1, "round": ')
    with caplog.at_level(logging.INFO, logger="fedsub"):
        compare(config, out, resume=True)
    assert f"skipping damaged checkpoint: {newest}" in caplog.text
    assert "fedavg continues after round 2 from" in caplog.text
    assert results(out) == results(tmp_path / "straight")


def test_resume_says_what_it_picked_up(tmp_path, tiny, caplog):
    config = config_lib.load(tiny)
    out = tmp_path / "out"
    interrupted(config, out, calls=6)  # fedavg done, fedsubavg stopped after round 2
    with caplog.at_level(logging.INFO, logger="fedsub"):
        compare(config, out, resume=True)
    assert f"fedavg finished earlier; its results are read back from {out / 'fedavg'}" in (
        caplog.text
    )
    checkpoint = out / "fedsubavg" / "checkpoints" / "round-000002"
    assert f"fedsubavg continues after round 2 from {checkpoint}" in caplog.text
    caplog.clear()
    out2 = tmp_path / "out2"
    interrupted(config, out2, calls=1)
    shutil.rmtree(out2 / "fedavg" / "checkpoints")
    with caplog.at_level(logging.INFO, logger="fedsub"):
        compare(config, out2, resume=True)
    assert "fedavg has no intact checkpoint; it starts from round 1" in caplog.text


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_output_file_follows_the_umask(tmp_path, tiny, umask):
    out = tmp_path / "out"
    previous = os.umask(umask)
    try:
        assert main(["compare", str(tiny), "--out", str(out), "--quiet"]) == 0
    finally:
        os.umask(previous)
    entries = [out, *out.rglob("*")]
    assert any(p.name == "model.safetensors" and "checkpoints" in str(p) for p in entries)
    for path in entries:
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert (path.stat().st_mode & 0o777) == expected, path


CSV = "user,clicked,city\nu1,1,paris\nu1,0,lyon\nu2,1,paris\nu2,0,nice\nu3,1,lyon\nu3,0,rome\n"
TABLE = """
[data]
name = "table"
path = "data/clicks.csv"
client_column = "user"
label_column = "clicked"
features = ["city"]

[train]
algorithms = ["fedavg"]
rounds = 2
clients_per_round = 2
local_steps = 1
batch_size = 2
"""


def test_a_relative_data_path_is_stored_resolved_and_failures_leave_no_folder(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    Path("conf").mkdir()
    Path("conf/t.toml").write_text(TABLE)
    argv = ["run", "conf/t.toml", "--out", "runs/a/b", "--quiet"]
    assert main(argv) == 2  # data/clicks.csv does not exist yet
    err = capsys.readouterr().err
    assert f"data.path {tmp_path / 'data' / 'clicks.csv'} does not exist" in err
    assert not Path("runs").exists()  # no folder holding only config.toml
    Path("empty").mkdir()
    assert main(["run", "conf/t.toml", "--out", "empty", "--quiet"]) == 2
    assert Path("empty").is_dir() and not any(Path("empty").iterdir())  # the user's: kept
    Path("data").mkdir()
    Path("data/clicks.csv").write_text(CSV)
    assert main(argv) == 0
    stored = config_lib.load(Path("runs/a/b/config.toml"))
    assert stored.data.path == str(tmp_path / "data" / "clicks.csv")
    monkeypatch.chdir(tmp_path / "conf")  # the stored run resumes from anywhere
    assert main(["run", "--resume", str(tmp_path / "runs/a/b"), "--quiet"]) == 0


def test_a_sweep_stopped_by_ctrl_c_says_how_to_resume_and_resumes(
    tmp_path, tiny, monkeypatch, capsys
):
    import fedsub.cli.commands as cli

    argv = ["compare", str(tiny), "--sweep", "train.lr=0.1,0.3", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "straight")]) == 0
    capsys.readouterr()

    @contextmanager
    def ctrl_c_after_11_rounds():  # value 0.1 done (8 rounds), 0.3 stopped in fedavg
        calls: list[int] = []
        yield lambda: calls.append(1) or len(calls) >= 11

    real = cli._stop_on_signals
    monkeypatch.setattr(cli, "_stop_on_signals", ctrl_c_after_11_rounds)
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out)]) == 130
    assert f"Resume with: fedsub compare --resume {out}" in capsys.readouterr().err
    assert not (out / "sweep.json").exists()
    monkeypatch.setattr(cli, "_stop_on_signals", real)
    assert main(["compare", "--resume", str(out), "--sweep", "train.lr=1", "--quiet"]) == 2
    assert main(["compare", "--resume", str(out), "--quiet"]) == 0
    assert json.loads((out / "sweep.json").read_text()) == json.loads(
        (tmp_path / "straight" / "sweep.json").read_text()
    )
    for value in ("0.1", "0.3"):
        folder = f"train.lr={value}"
        assert results(out / folder) == results(tmp_path / "straight" / folder)


def test_sweep_refuses_a_used_folder(tmp_path, tiny):
    base = config_lib.read_toml(tiny)
    sweep("train.lr", ["0.1"], base, tmp_path / "s")
    with pytest.raises(FedsubError, match=re.escape("already holds a run")):
        sweep("train.lr", ["0.2"], base, tmp_path / "s")
    sweep("train.lr", ["0.2"], base, tmp_path / "s", overwrite=True)
    assert not (tmp_path / "s" / "train.lr=0.1").exists()


def test_a_sweep_that_fails_before_training_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("t.toml").write_text(TABLE)
    base = config_lib.read_toml(Path("t.toml"))
    with pytest.raises(FedsubError, match=re.escape(str(tmp_path / "data" / "clicks.csv"))):
        sweep("train.lr", ["0.1", "0.2"], base, tmp_path / "runs" / "s")
    assert not (tmp_path / "runs").exists()


def test_a_sweep_value_holding_a_path_is_one_folder():
    from fedsub.runs.experiment import value_folder

    assert value_folder("data.path", "/x/a.csv") == "data.path=%2Fx%2Fa.csv"
    assert value_folder("train.lr", "0.1") == "train.lr=0.1"
    assert value_folder("data.path", "a%2Fb") != value_folder("data.path", "a/b")


def test_overwrite_never_follows_a_link_out_of_the_run_folder(tmp_path, tiny, capsys):
    """A run's algorithm folder replaced by a link to the user's own folder: --overwrite
    moves nothing through it and the new run refuses to write through it; the folder is left
    as it was."""
    out = tmp_path / "out"
    assert main(["compare", str(tiny), "--out", str(out), "--quiet"]) == 0
    mine = tmp_path / "mine"
    shutil.move(out / "fedavg", mine)
    (out / "fedavg").symlink_to(mine)
    before = {p: p.read_bytes() for p in [*out.rglob("*"), *mine.rglob("*")] if p.is_file()}
    argv = ["compare", str(tiny), "--out", str(out), "--quiet", "--overwrite"]
    capsys.readouterr()
    assert main([*argv, "--set", "train.lr=0.3"]) == 2
    assert f"{out / 'fedavg'} is a link (to {mine}); the run would write through it" in (
        capsys.readouterr().err
    )
    after = {p: p.read_bytes() for p in [*out.rglob("*"), *mine.rglob("*")] if p.is_file()}
    assert after == before and (out / "fedavg").is_symlink()


def test_resume_with_an_out_naming_another_folder_is_refused(tmp_path, tiny, capsys):
    out = tmp_path / "out"
    interrupted(config_lib.load(tiny), out, calls=1)
    assert main(["compare", "--resume", str(out), "--out", str(tmp_path / "elsewhere")]) == 2
    err = capsys.readouterr().err
    assert f"--resume {out} continues that run in its own folder; --out " in err
    assert not (tmp_path / "elsewhere").exists()
    assert main(["compare", "--resume", str(out), "--out", str(out), "--quiet"]) == 0


def _manifests() -> dict[str, list[str]]:
    """Every run kind's manifest of outputs, as its run.json lists them."""
    from fedsub.files.run_folder import comparison_outputs, sweep_outputs
    from fedsub.flower.apps import FLOWER_OUTPUTS

    return {
        "comparison": comparison_outputs(["<algorithm>"]),
        "sweep": sweep_outputs(),
        "flower": list(FLOWER_OUTPUTS),
    }


def _names(text: str, name: str) -> bool:
    """Whether a backticked path of the page names the file or folder ``name``."""
    return (
        text == name
        or text.endswith(f"/{name}")
        or text.startswith(f"{name}/")
        or (f"/{name}/" in text)
    )


@pytest.mark.parametrize("kind", ["comparison", "sweep", "flower"])
def test_the_run_folder_page_names_every_file_a_run_writes(kind):
    """docs/getting-started/run-folder.md once omitted checkpoints/, privacy.json,
    heat_source.json and rejections.jsonl: every pattern of every run manifest (a new output
    must be in one, DEVELOPERS.md) has its name in the page, in backticks."""
    page = (Path(__file__).parents[1] / "docs/getting-started/run-folder.md").read_text()
    named = set(re.findall(r"`([^`]+)`", page))
    missing = []
    for pattern in _manifests()[kind]:
        name = pattern.rstrip("/").rsplit("/", 1)[-1]
        if not any(_names(text, name) for text in named):
            missing.append(pattern)
    assert not missing, f"run-folder.md names none of {missing}"
