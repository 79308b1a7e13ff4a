"""`fedsub reproduce`: every registered experiment runs at smoke size on generated data of its
dataset's real format (parts whose data are not public say so), the paper's numbers are all
there with their location, the shipped configs carry Table 4's and Table 5's settings, and
the verdicts are checked on hand-made results in tests/test_reproduce_verdicts.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedsub.cli import main
from fedsub.engine.loop import Interrupted
from fedsub.errors import FedsubError
from fedsub.reproduce import registry, running, status
from fedsub.reproduce.registry import EXPERIMENTS, Settings

from .cifar_files import write_archive
from .test_amazon_din import write_user_files
from .test_configs_run import amazon_ratings, sent140_csv
from .test_images import write_image_set


def write_ml1m(folder: Path, users: int = 6) -> Path:
    """MovieLens-1M's three files for ``users`` users and 4 movies (K = 3 can be drawn)."""
    root = folder / "ml-1m"
    root.mkdir(parents=True)
    ages = (1, 18, 25, 35, 45, 50, 56)
    (root / "users.dat").write_text(
        "".join(f"{u}::{'FM'[u % 2]}::{ages[u % 7]}::10::48067\n" for u in range(1, users + 1))
    )
    (root / "movies.dat").write_text(
        "".join(f"{m}::Movie {m} (1995)::Drama\n" for m in range(1, 5))
    )
    rng = np.random.default_rng(0)
    lines = [
        f"{u}::{m}::{int(rng.integers(1, 6))}::9783{u:02d}{m:04d}\n"
        for u in range(1, users + 1)
        for m in range(1, 5)
        for _ in range(3)
    ]
    (root / "ratings.dat").write_text("".join(lines))
    return root


WRITERS = {
    "movielens-1m": write_ml1m,
    "sent140": sent140_csv,
    "amazon-electronics": amazon_ratings,
    "amazon-fedsubavg": lambda f: write_user_files(f / "amazon", users=6, lines=10),
    "mnist": lambda f: write_image_set(f / "mnist"),
    "fashion-mnist": lambda f: write_image_set(f / "fmnist"),
    "cifar10": lambda f: write_archive(f / "cifar-10-python.tar.gz", "cifar10", per_batch=20),
    "cifar100": lambda f: write_archive(f / "cifar-100-python.tar.gz", "cifar100", per_batch=400),
}


@pytest.fixture(scope="module")
def data_files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("reproduce-data")
    return {name: str(write(folder)) for name, write in WRITERS.items()}


@pytest.fixture(scope="module")
def trained_runs() -> dict:
    return {}


@pytest.fixture
def trained_once(trained_runs, monkeypatch):
    """Several experiments draw on one run (a table and the figures of its curves): at smoke
    size each distinct run trains once in this module, and every experiment judges its
    results."""
    original = running._train

    def train_once(run, configs, folder, smoke, data_sets, user, folders):
        key = (run, tuple(data_sets))
        if key not in trained_runs:
            trained_runs[key] = original(run, configs, folder, smoke, data_sets, user, folders)
        return trained_runs[key]

    monkeypatch.setattr(running, "_train", train_once)


PARTS = [(e.id, part.name) for e in EXPERIMENTS.values() for part in e.parts]


@pytest.mark.parametrize(("experiment_id", "part_name"), PARTS, ids=[f"{e}:{p}" for e, p in PARTS])
def test_every_experiment_runs_at_smoke_size(
    experiment_id, part_name, tmp_path, data_files, trained_once
):
    part = EXPERIMENTS[experiment_id].part(part_name)
    missing = status.config_missing(part, registry.configs_folder())
    if missing:
        pytest.fail(f"cannot run: {missing}")
    path = data_files.get(part.data.name)
    out = tmp_path / experiment_id
    (result,) = running.reproduce(experiment_id, out, smoke=True, part=part_name, data_path=path)
    if part.action is None:
        assert result.status == "cannot run" and part.data.name in result.verdict
        return
    assert result.status in ("ran", "ran (smoke size)"), result
    assert result.verdict
    record = json.loads((out / "reproduce.json").read_text())
    assert record["parts"][0]["verdict"] == result.verdict
    for plot in result.plots:
        assert Path(plot).exists(), plot


def test_parts_without_their_data_name_the_dataset_and_its_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSUB_DATA", str(tmp_path / "empty-cache"))
    (result,) = running.reproduce("001-tab2", tmp_path / "out", part="movielens")
    assert result.status == "needs data"
    assert result.verdict == "needs dataset movielens-1m: `fedsub data fetch movielens-1m`"
    assert ("rounds to target: fedsubavg", "100", "n/a") in result.rows  # the paper's beside
    (alibaba,) = running.reproduce("001-tab2", tmp_path / "out2", part="alibaba")
    assert alibaba.status == "cannot run" and "not public" in alibaba.verdict


def test_every_part_that_runs_has_the_papers_numbers_with_their_location():
    for e in EXPERIMENTS.values():
        for part in e.parts:
            if part.action is None and not e.id.startswith("002-tab"):
                continue
            numbers = registry.paper_numbers(e.id, part.name)
            assert numbers is not None, (e.id, part.name)
            assert numbers.where.startswith(f"seed {e.seed}, "), (e.id, part.name)
    for experiment_id, parts in registry._paper_table().items():
        assert experiment_id in EXPERIMENTS
        for name in parts:
            EXPERIMENTS[experiment_id].part(name)


def test_the_shipped_table2_configs_carry_table4_and_table5():
    """002-tab4 / 002-tab5 at full size: the configs' learning rates, B, I, K and FedAdam's
    hyperparameters are the paper's."""
    for experiment_id in ("002-tab4", "002-tab5"):
        for part in EXPERIMENTS[experiment_id].parts:
            if not isinstance(part.action, Settings):
                continue
            result = running.run_part(
                EXPERIMENTS[experiment_id],
                part,
                Path("/nonexistent"),
                False,
                None,
                [],
                registry.configs_folder(),
                running.Folders(),
            )
            assert result.verdict.startswith("same settings"), (experiment_id, part.name, result)


def test_a_setting_that_differs_is_named(tmp_path):
    configs = tmp_path / "configs"
    configs.mkdir()
    text = (registry.configs_folder() / "amazon-din.toml").read_text()
    (configs / "amazon-din.toml").write_text(text.replace("server_lr = 0.001", "server_lr = 0.01"))
    part = EXPERIMENTS["002-tab5"].part("amazon-authors")
    result = running.run_part(
        EXPERIMENTS["002-tab5"], part, tmp_path, False, None, [], configs, running.Folders()
    )
    assert result.verdict.startswith("differs: fedadam server_lr is 0.01, the paper's 0.001")


def test_a_stopped_part_resumes_and_a_finished_one_is_not_overwritten(tmp_path):
    out = tmp_path / "fig4"
    with pytest.raises(Interrupted):
        running.reproduce(
            "004-fig4",
            out,
            smoke=True,
            part="synthetic-1-1",
            folders=running.Folders(stop_requested=lambda: True),
        )
    (resumed,) = running.reproduce(
        "004-fig4", out, smoke=True, part="synthetic-1-1", folders=running.Folders(resume=True)
    )
    (fresh,) = running.reproduce("004-fig4", tmp_path / "fresh", smoke=True, part="synthetic-1-1")
    assert resumed.verdict == fresh.verdict and resumed.rows == fresh.rows
    with pytest.raises(FedsubError, match="holds"):
        running.reproduce("004-fig4", out, smoke=True, part="synthetic-1-1")


def test_cli_lists_and_runs_a_closed_form(tmp_path, capsys):
    assert main(["reproduce"]) == 0
    listing = capsys.readouterr().out
    for experiment_id in EXPERIMENTS:
        assert f"\n{experiment_id}  " in listing
    assert "needs dataset" in listing and "runs here" in listing
    out = tmp_path / "fig2"
    assert main(["reproduce", "001-fig2", "--smoke", "--out", str(out), "--quiet"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("001-fig2 example-1: smoke size, not comparable: within ")
    assert (out / "example-1" / "example1.png").exists()
    assert "| fedavg w1 after 5 rounds |" in (out / "reproduce.md").read_text()
    assert main(["reproduce", "001-fig9"]) == 2
    assert "no experiment '001-fig9'" in capsys.readouterr().err


# --- every flag honoured or refused; the exit status says whether what was asked ran -------

REFUSED = {
    "a --set on a closed form": (["001-fig2", "--set", "train.rounds=3"], "--set", "example-1"),
    "a --set on settings": (["002-tab4", "--set", "train.rounds=3"], "--set", "movielens"),
    "a --set on a part with no loader": (
        ["001-tab2", "--part", "alibaba", "--set", "train.rounds=3"],
        "--set",
        "alibaba",
    ),
    "a --set of the key the part sweeps": (
        ["001-tab3", "--part", "movielens", "--set", "train.clients_per_round=5"],
        "--set",
        "movielens",
    ),
    "an out-of-range --set, before any part trains": (
        ["004-fig4", "--smoke", "--set", "train.rounds=-1"],
        "train.rounds",
        "synthetic-0-0",
    ),
    "an unknown key": (["004-fig4", "--smoke", "--set", "trian.rounds=2"], "trian", "004-fig4"),
    "a bad --set on a part whose data are not here": (
        ["001-tab2", "--part", "movielens", "--set", "train.lr=-1"],
        "train.lr",
        "movielens",
    ),
    "a --configs that does not exist": (["004-fig4", "--configs", "/nonexistent"], "--configs", ""),
    "a --configs on a closed form": (["001-fig2", "--configs", "."], "--configs", "example-1"),
    "a --data-path on generated data": (["004-fig4", "--data-path", "."], "--data-path", "0-0"),
    "a --data-path on a closed form": (["001-fig2", "--data-path", "."], "--data-path", "example"),
    "a --data-path that does not exist": (
        ["001-tab2", "--part", "movielens", "--data-path", "/nonexistent/ml-1m"],
        "--data-path",
        "movielens-1m",
    ),
    "an empty --part": (["004-fig4", "--part", ""], "--part", "synthetic-0-0, synthetic-1-1"),
    "an unknown --part": (["004-fig4", "--part", "fig9"], "--part fig9", "synthetic-1-1"),
    "--resume with nothing to resume": (["004-fig4", "--smoke", "--resume"], "--resume", "fig4"),
    "an experiment with nothing to run": (["004-tab1"], "004-tab1", "nothing to run"),
    "options of a run without an id": (["--part", "movielens"], "--part", "without an ID"),
    "an empty --out": (["004-fig4", "--out", ""], "--out", "empty"),
    "an empty --configs": (["004-fig4", "--configs", ""], "--configs", "empty"),
    "a blank --data-path": (["001-tab2", "--data-path", " "], "--data-path", "blank"),
}


@pytest.mark.parametrize("case", REFUSED.values(), ids=list(REFUSED))
def test_an_option_a_part_cannot_honour_is_refused_before_anything_runs(
    case, tmp_path, capsys, monkeypatch
):
    """Each ends in one `fedsub: error:` line naming the flag and the part (or the choices),
    exit 2, nothing written: not silently ignored, not a fresh run."""
    argv, flag, part = case
    monkeypatch.setenv("FEDSUB_DATA", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(tmp_path)
    out = [] if "--out" in argv else ["--out", str(tmp_path / "out")]
    assert main(["reproduce", *argv, *out, "--quiet"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedsub: error: "), captured.err
    assert flag in lines[0] and part in lines[0], lines[0]
    assert sorted(tmp_path.iterdir()) == [], "something was written"


def test_a_set_reaches_the_runs_it_overrides(tmp_path, capsys):
    out = tmp_path / "fig4"
    argv = ["reproduce", "004-fig4", "--part", "synthetic-0-0", "--smoke", "--out", str(out)]
    assert main([*argv, "--set", "train.rounds=1", "--quiet"]) == 0
    written = (out / "synthetic-0-0" / "config.toml").read_text()
    assert "rounds = 1\n" in written  # smoke size's 2 rounds, then the user's --set


def test_exit_1_names_each_part_that_did_not_run_and_the_report_is_written(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("FEDSUB_DATA", str(tmp_path / "empty-cache"))
    out = tmp_path / "t2"
    assert main(["reproduce", "001-tab2", "--part", "movielens", "--out", str(out), "--quiet"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (
        "fedsub: error: 001-tab2: 1 of 1 parts did not run (movielens: needs dataset "
        "movielens-1m: `fedsub data fetch movielens-1m`)"
    )
    assert json.loads((out / "reproduce.json").read_text())["parts"][0]["status"] == "needs data"
    assert main(["reproduce", "001-tab2", "--part", "alibaba", "--out", str(out / "a")]) == 1
    assert "alibaba: cannot run" in capsys.readouterr().err
    unreadable = tmp_path / "ml-1m"
    unreadable.mkdir()
    (unreadable / "ratings.dat").write_text("not::ratings\n")
    argv = ["reproduce", "001-tab2", "--part", "movielens", "--smoke", "--quiet"]
    assert main([*argv, "--data-path", str(unreadable), "--out", str(out / "u")]) == 1
    assert "movielens: data error: " in capsys.readouterr().err


def test_a_stopped_reproduction_says_the_command_that_continues_it(tmp_path, capsys, monkeypatch):
    """SIGTERM (what a batch scheduler sends) exits 143 with a command that, run as printed,
    continues the same runs."""
    import contextlib
    import shlex
    import signal

    from fedsub.cli import commands as cli

    @contextlib.contextmanager
    def terminated():
        yield cli._StopRequest(signal.SIGTERM)

    out = tmp_path / "fig 4"  # a space, quoted in the printed command
    argv = ["reproduce", "004-fig4", "--part", "synthetic-1-1", "--smoke", "--out", str(out)]
    with monkeypatch.context() as patched:
        patched.setattr(cli, "_stop_on_signals", terminated)
        assert main([*argv, "--set", "eval.every=2", "--quiet"]) == 143
    line = capsys.readouterr().err.strip().splitlines()[-1]
    command = line.split("continue with: ", 1)[1]
    words = shlex.split(command)
    assert words[:2] == ["fedsub", "reproduce"] and words[-1] == "--resume"
    assert "eval.every=2" in words and str(out) in words
    assert main([*words[1:], "--quiet"]) == 0


def test_table1_counts_the_authors_whole_amazon_files(tmp_path):
    """Table 1's heat is over all of the authors' files (their training set), not fedsub's 80%
    split: item 999, which five users hold only in their last 20% of lines and two users in
    their first line, has heat 7 (2 on the split); every other id heat 1."""
    folder = tmp_path / "amazon"
    folder.mkdir()
    for user in range(10):
        lines = [f"1\t{user}\t{1000 + 10 * user + n}\t{5000 + 10 * user + n}" for n in range(10)]
        if user < 5:
            lines[9] = f"0\t{user}\t999\t{5000 + 10 * user + 9}"  # in the held-out 20%
        elif user < 7:
            lines[0] = f"0\t{user}\t999\t{5000 + 10 * user}"
        (folder / f"user_{user}").write_text("\n".join(lines) + "\n")
    (result,) = running.reproduce(
        "001-tab1", tmp_path / "out", part="amazon-authors", data_path=str(folder)
    )
    stats = json.loads((tmp_path / "out" / "amazon-authors" / "stats.json").read_text())
    assert (stats["clients"], stats["samples"], stats["train_samples"]) == (10, 100, 100)
    assert (stats["heat_max"], stats["heat_dispersion"]) == (7, 7.0)
    rows = {cell: ours for cell, _, ours in result.rows}
    assert (rows["heat_dispersion"], rows["samples_per_client"]) == ("7", "10")


# --- issue 47: what a report records, MovieLens-100K, a resume through a real stop ------------

STOP_AT_FEDADAM_ROUND_3 = """
import os, signal, sys
from fedsub import progress
from fedsub.cli import main
original = progress.Reporter.round
def stop_after(self, label, round_index):
    original(self, label, round_index)
    if label == "fedadam" and round_index == 3:
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, at a known round
progress.Reporter.round = stop_after
sys.exit(main(sys.argv[1:]))
"""

SMALL_FEDADAM = [
    "--set", 'train.algorithms=["fedavg", "fedadam"]',
    "--set", "train.rounds=6",
    "--set", "train.clients_per_round=3",
    "--set", "eval.every=1",
    "--set", "execution.threads=1",
]  # fmt: skip


def _curves(folder: Path, name: str) -> list[dict]:
    lines = (folder / name / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed"} for line in lines]


def test_a_reproduction_stopped_by_sigterm_resumes_to_the_uninterrupted_numbers(tmp_path):
    """FedAdam on the authors' Amazon format, with --set overrides, stopped by SIGTERM after
    its round 3 of 6 (FedAvg before it finished) and continued with the printed --resume
    command: every round's numbers and the final models are the uninterrupted run's, bit for
    bit."""
    import shlex
    import subprocess
    import sys

    data = write_user_files(tmp_path / "amazon", users=8, lines=12)
    argv = ["reproduce", "001-tab2", "--part", "amazon-authors", "--data-path", str(data)]
    argv += [*SMALL_FEDADAM, "--quiet"]
    stopped = subprocess.run(
        [sys.executable, "-c", STOP_AT_FEDADAM_ROUND_3, *argv, "--out", str(tmp_path / "s")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert stopped.returncode == 143, stopped.stderr
    assert "stopped after round 3" in stopped.stderr
    assert len(_curves(tmp_path / "s" / "amazon-authors", "fedadam")) == 4  # rounds 0-3
    again = shlex.split(stopped.stderr.strip().splitlines()[-1].split("continue with: ", 1)[1])
    resumed = subprocess.run(
        [sys.executable, "-m", "fedsub", *again[1:], "--quiet"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert main([*argv, "--out", str(tmp_path / "u")]) == 0
    for name in ("fedavg", "fedadam"):
        ran, whole = tmp_path / "s" / "amazon-authors", tmp_path / "u" / "amazon-authors"
        assert _curves(ran, name) == _curves(whole, name), name
        model = Path(name) / "model.safetensors"
        assert (ran / model).read_bytes() == (whole / model).read_bytes(), name
    report = json.loads((tmp_path / "s" / "reproduce.json").read_text())
    assert report["parts"][0]["setting"]["user_overrides"] == SMALL_FEDADAM[1::2]


def test_the_report_records_every_override_the_data_and_its_split_and_fedsub(tmp_path):
    from fedsub import __version__

    data = write_user_files(tmp_path / "amazon", users=6, lines=10)
    out = tmp_path / "out"
    argv = ["reproduce", "001-tab2", "--part", "amazon-authors", "--smoke", "--quiet"]
    assert main([*argv, "--data-path", str(data), "--set", "train.lr=0.05", "--out", str(out)]) == 0
    record = json.loads((out / "reproduce.json").read_text())
    request = record["request"]
    assert request["overrides"] == ["train.lr=0.05"] and request["smoke"] is True
    assert request["data_path"] == str(data.absolute())
    assert request["fedsub"]["version"] == __version__
    commit = request["fedsub"]["commit"]
    assert commit is None or len(commit) == 40  # a git checkout here: its commit
    setting = record["parts"][0]["setting"]
    assert setting["overrides"][-1] == "train.lr=0.05"
    assert f"data.path={json.dumps(str(data.absolute()))}" in setting["overrides"]
    assert (setting["dataset"], setting["paper_dataset"]) == ("amazon-fedsubavg",) * 2
    assert setting["test_fraction"] == 0.2 and "not on the paper's test set" in setting["split"]
    assert (setting["threads"], setting["threads_used"], setting["seed"]) == (1, 1, 0)
    markdown = (out / "reproduce.md").read_text()
    assert "--set: train.lr=0.05" in markdown and f"fedsub {__version__}" in markdown
    assert "split: fedsub's own" in markdown and "Overrides: " in markdown
    assert "\n- holds: " in markdown or "\n- differs: " in markdown or "\n- not checked" in markdown


def test_fedsubs_commit_is_none_outside_a_checkout(tmp_path):
    source = running.fedsub_source(tmp_path)
    assert source["commit"] is None and source["version"]


def test_movielens_parts_read_movielens_100k_through_data_path(tmp_path):
    """The MovieLens rows are MovieLens-1M's in the paper; MovieLens-100K's files (a folder or
    ml-100k.zip) run them with the paper's dataset named beside fedsub's."""
    import zipfile

    from .test_movielens import write_100k

    root = write_100k(tmp_path / "data")
    assert registry.dataset_at(registry.MOVIELENS, str(root)) == "movielens-100k"
    assert registry.dataset_at(registry.MOVIELENS, str(root.parent)) == "movielens-100k"
    archive = tmp_path / "ml-100k.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for f in root.iterdir():
            z.write(f, f"ml-100k/{f.name}")
    assert registry.dataset_at(registry.MOVIELENS, str(archive)) == "movielens-100k"
    one_m = write_ml1m(tmp_path / "one-m")
    assert registry.dataset_at(registry.MOVIELENS, str(one_m)) == "movielens-1m"
    out = tmp_path / "out"
    argv = ["reproduce", "001-tab2", "--part", "movielens", "--smoke", "--quiet"]
    assert main([*argv, "--data-path", str(root), "--out", str(out)]) == 0
    setting = json.loads((out / "reproduce.json").read_text())["parts"][0]["setting"]
    assert (setting["dataset"], setting["paper_dataset"]) == ("movielens-100k", "movielens-1m")
    assert "movielens-100k (the paper's: movielens-1m)" in (out / "reproduce.md").read_text()


def test_threads_left_to_torch_are_pinned_and_a_resume_reads_them_back(tmp_path):
    import torch

    run = registry.Run("amazon-din.toml")
    path = registry.configs_folder() / "amazon-din.toml"
    sets = running._run_overrides(run, False, [], [], path, tmp_path)
    assert sets[-1] == f"execution.threads={torch.get_num_threads()}"
    (tmp_path / "config.toml").write_text("[execution]\nthreads = 3\n")
    fresh = running._run_overrides(run, False, [], [], path, None)  # not a resume: this process's
    assert fresh[-1] == f"execution.threads={torch.get_num_threads()}"
    assert running._run_overrides(run, False, [], [], path, tmp_path)[-1] == "execution.threads=3"
    user = running._run_overrides(run, False, [], ["execution.threads=2"], path, tmp_path)
    assert user[-1] == "execution.threads=2"  # --set comes last
    smoke = running._run_overrides(run, True, [], [], path, tmp_path)
    assert not any(s.startswith("execution.threads=3") for s in smoke)  # smoke size sets 1


def test_several_seeds_report_mean_spread_and_judge_each_claim_on_every_seed(tmp_path):
    """--seeds 3: train.seed 0, 1, 2 (the first in OUT/<part>, the others beside it), fedsub's
    numbers as mean ± std (min-max), each claim judged on every seed; a part that trains
    nothing refuses --seeds."""
    data = write_user_files(tmp_path / "amazon", users=8, lines=12)
    out = tmp_path / "out"
    argv = ["reproduce", "001-fig3", "--part", "amazon-authors", "--data-path", str(data)]
    assert main([*argv, *SMALL_FEDADAM, "--seeds", "3", "--quiet", "--out", str(out)]) == 0
    for folder in ("amazon-authors", "amazon-authors@train.seed=1", "amazon-authors@train.seed=2"):
        assert (out / folder / "fedadam" / "metrics.jsonl").exists(), folder
    finals = {
        seed: json.loads((out / folder / "summary.json").read_text())["algorithms"]["fedadam"]
        for seed, folder in enumerate(
            ["amazon-authors", "amazon-authors@train.seed=1", "amazon-authors@train.seed=2"]
        )
    }
    assert len({f["best"]["test_auc"] for f in finals.values()}) > 1  # the seeds differ
    part = json.loads((out / "reproduce.json").read_text())["parts"][0]
    assert part["setting"]["seeds"] == [0, 1, 2]
    rows = {cell: ours for cell, _, ours in part["rows"]}
    aucs = [finals[s]["best"]["test_auc"] for s in range(3)]
    mean = sum(aucs) / 3
    assert rows["best test_auc: fedadam"].startswith(f"{mean:.4g} ± ")
    assert f"({min(aucs):.4g}-{max(aucs):.4g})" in rows["best test_auc: fedadam"]
    assert all("seeds" in line for line in part["checks"]), part["checks"]
    markdown = (out / "reproduce.md").read_text()
    assert "train.seed 0, 1, 2 (3 runs: mean ± std (min-max))" in markdown
    refused = ["reproduce", "002-tab4", "--part", "amazon-authors", "--seeds", "2"]
    assert main([*refused, "--out", str(tmp_path / "t")]) == 2
