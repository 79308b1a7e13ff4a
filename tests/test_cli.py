"""The command line end to end on a tiny configuration, checking every output file."""

import json
import os
import re
import subprocess
import sys

import pytest

from fedsub.cli import main

TINY = """
[data]
name = "synthetic-sparse"
num_users = 60
num_items = 40
mean_samples_per_user = 10

[train]
algorithms = ["fedavg", "fedsubavg"]
rounds = 6
clients_per_round = 8
local_steps = 3
batch_size = 4
lr = 0.2

[eval]
every = 2
train_loss_samples = 200
target_train_loss = 0.69
"""


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


def test_compare_writes_every_output(tmp_path, tiny_config, capsys):
    out = tmp_path / "out"
    assert main(["compare", str(tiny_config), "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "| fedavg |" in printed and "| fedsubavg |" in printed

    assert (out / "config.toml").read_text().count("[train]") == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target"] == {"train_loss": 0.69}
    for name in ("fedavg", "fedsubavg"):
        lines = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert [x["round"] for x in lines] == [0, 2, 4, 6]
        for line in lines:
            assert {"train_loss", "test_loss", "test_accuracy", "test_auc", "elapsed"} <= set(line)
        entry = summary["algorithms"][name]
        assert entry["final"]["train_loss"] == lines[-1]["train_loss"]
        assert entry["best"]["test_auc"] == max(x["test_auc"] for x in lines)
        reached = [x["round"] for x in lines if x["train_loss"] <= 0.69]
        assert entry["rounds_to_target"] == (reached[0] if reached else None)
    assert (out / "summary.md").read_text().startswith("Target: train loss <= 0.69")
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_one_algorithm_and_resolved_config_reruns_identically(tmp_path, tiny_config):
    first, second = tmp_path / "a", tmp_path / "b"
    assert (
        main(["run", str(tiny_config), "--algorithm", "fedsubavg", "--out", str(first), "--quiet"])
        == 0
    )
    assert (
        main(
            [
                "run",
                str(first / "config.toml"),
                "--algorithm",
                "fedsubavg",
                "--out",
                str(second),
                "--quiet",
            ]
        )
        == 0
    )
    strip = lambda p: [  # noqa: E731
        {k: v for k, v in json.loads(x).items() if k != "elapsed"}
        for x in p.read_text().splitlines()
    ]
    assert strip(first / "fedsubavg" / "metrics.jsonl") == strip(
        second / "fedsubavg" / "metrics.jsonl"
    )


def test_run_refuses_an_ambiguous_algorithm_choice(tmp_path, tiny_config, capsys):
    assert main(["run", str(tiny_config), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "pass --algorithm NAME" in capsys.readouterr().err


def test_data_stats_prints_table1_row_and_plots(tmp_path, capsys):
    plot = tmp_path / "heat.png"
    assert (
        main(
            ["data", "stats", "synthetic-sparse", "--set", "data.num_users=80", "--plot", str(plot)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "heat dispersion" in printed
    assert re.search(r"clients\s+│\s+80\s", printed)
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_console_script_reports_bad_config_without_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nrounds = -3\n")
    result = subprocess.run(
        [sys.executable, "-m", "fedsub.cli", "compare", str(bad), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "train.rounds = -3 is out of range; expected >= 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_unwritable_output_folder_is_reported_before_training(tmp_path, tiny_config, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main(["compare", str(tiny_config), "--out", str(blocker / "sub"), "--quiet"]) == 2
    assert f"cannot be made: {blocker} is a file" in capsys.readouterr().err


def test_central_min_target_runs_central_sgd_first_and_sweep_prints_table3(tmp_path):
    config = tmp_path / "t.toml"
    config.write_text(
        TINY.replace('algorithms = ["fedavg", "fedsubavg"]', 'algorithms = ["fedsubavg"]').replace(
            "target_train_loss = 0.69", 'target_train_loss = "central-min"'
        )
        + "\n[algorithms.fedsubavg]\nlr = 0.3\n"
    )
    out = tmp_path / "out"
    assert main(["compare", str(config), "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["algorithms"]) == ["central-sgd", "fedsubavg"]
    central = [
        json.loads(x) for x in (out / "central-sgd" / "metrics.jsonl").read_text().splitlines()
    ]
    assert summary["target"]["train_loss"] == min(x["train_loss"] for x in central)
    # CentralSGD reaches its own minimum (train loss <= target), at the round it attains it
    lowest = min(central, key=lambda x: x["train_loss"])
    assert summary["algorithms"]["central-sgd"]["rounds_to_target"] == lowest["round"]
    table = (out / "summary.md").read_text()
    assert "| | central-sgd | fedsubavg |" in table
    assert "lr = 0.3" in (out / "config.toml").read_text()

    sweep_out = tmp_path / "sweep"
    assert (
        main(
            [
                "compare",
                str(config),
                "--sweep",
                "train.clients_per_round=4,8",
                "--out",
                str(sweep_out),
                "--quiet",
            ]
        )
        == 0
    )
    sweep = json.loads((sweep_out / "sweep.json").read_text())
    assert sweep["values"] == ["4", "8"]
    for value in ("4", "8"):
        inner = json.loads(
            (sweep_out / f"train.clients_per_round={value}" / "summary.json").read_text()
        )
        assert (
            sweep["rounds_to_target"]["fedsubavg"][value]
            == (inner["algorithms"]["fedsubavg"]["rounds_to_target"])
        )
    assert "| fedsubavg |" in (sweep_out / "sweep.md").read_text()


def test_gradient_norms_are_logged_when_asked(tmp_path, tiny_config):
    out = tmp_path / "out"
    assert (
        main(
            [
                "run",
                str(tiny_config),
                "--algorithm",
                "fedsubavg",
                "--out",
                str(out),
                "--quiet",
                "--set",
                "eval.gradient_norms=true",
            ]
        )
        == 0
    )
    lines = [json.loads(x) for x in (out / "fedsubavg" / "metrics.jsonl").read_text().splitlines()]
    assert all(x["precond_grad_norm_sq"] >= x["grad_norm_sq"] > 0 for x in lines)


def test_train_threads_sets_torchs_thread_count_and_the_results_do_not_change(
    tmp_path, tiny_config
):
    import torch

    before = torch.get_num_threads()
    try:
        outs = {}
        for threads in (0, 1):
            out = tmp_path / f"t{threads}"
            argv = ["compare", str(tiny_config), "--set", f"execution.threads={threads}"]
            assert main([*argv, "--out", str(out), "--quiet"]) == 0
            outs[threads] = json.loads((out / "summary.json").read_text())
            if threads:
                assert torch.get_num_threads() == threads
        for name, entry in outs[0]["algorithms"].items():
            for metric, value in entry["final"].items():
                assert outs[1]["algorithms"][name]["final"][metric] == pytest.approx(value, 1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("plot", "message"),
    [
        ("{tmp}/missing/x.png", "the folder {tmp}/missing does not exist"),
        ("{tmp}/x.csv", "its suffix .csv is not an image format; end the name with one of"),
        ("{tmp}", "is a folder; give an image file"),
        ("", "--plot is empty"),
    ],
)
def test_data_stats_refuses_a_plot_path_before_loading_anything(tmp_path, capsys, plot, message):
    argv = ["data", "stats", "synthetic-sparse", "--plot", plot.format(tmp=tmp_path)]
    assert main([*argv, "--set", "data.num_users=1000000000"]) == 2  # never generated
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and "Traceback" not in err
    assert sorted(tmp_path.iterdir()) == []


EMPTY_TEXTS = [
    (["compare", "--resume", ""], "--resume is empty"),
    (["run", "--resume", " "], "--resume is blank"),
    (["compare", "--out", ""], "--out is empty"),
    (["compare", ""], "CONFIG is empty"),
    (["run", "  ", "--algorithm", "fedavg"], "CONFIG is blank"),
    (["compare", "--sweep", "train.lr=0.1,0.2", "--out", " "], "--out is blank"),
    (["data", "stats", "synthetic-sparse", "--plot", ""], "--plot is empty"),
    (["data", "fetch", "mnist", "--url", ""], "--url is empty"),
    (["data", "fetch", "mnist", "--checksum", " "], "--checksum is blank"),
    (["reproduce", "004-fig4", "--data-path", ""], "--data-path is empty"),
    (["reproduce", "--configs", ""], "--configs is empty"),
    (["compare", "--sweep", ""], "--sweep '': expected section.key="),
    (["compare", "--resume", "runs/x", "--sweep", ""], "--resume continues a run as it was"),
    (["run", "--resume", "runs/x", "--algorithm", ""], "--resume continues a run as it was"),
]


@pytest.mark.parametrize(
    ("argv", "message"), EMPTY_TEXTS, ids=[" ".join(a) for a, _ in EMPTY_TEXTS]
)
def test_an_empty_or_blank_path_is_an_error_naming_its_flag(
    argv, message, tmp_path, capsys, monkeypatch
):
    """The reported bug: `fedsub compare --resume ""` trained a fresh default run and exited 0
    (an empty path read as "not given"); `--out ""` would be the current folder."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fedsub: error: {message}"), lines
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing written


def test_a_config_file_with_a_byte_order_mark_is_read(tmp_path, tiny_config, capsys):
    """A config saved by a Windows editor (UTF-8 with a BOM) runs as the same file without."""
    from fedsub import config as config_lib

    with_bom = tmp_path / "bom.toml"
    with_bom.write_bytes(b"\xef\xbb\xbf" + tiny_config.read_bytes())
    assert config_lib.load(with_bom) == config_lib.load(tiny_config)
    text = "\ufeff" + tiny_config.read_text()
    assert config_lib.Config.from_toml(text) == config_lib.load(tiny_config)
    assert main(["data", "stats", str(with_bom)]) == 0


QUICK_COMMANDS = [["--version"], ["--help"], ["run", "--help"], ["reproduce"], ["reproduce", "-h"]]


def test_the_cli_and_its_quick_commands_do_not_import_torch():
    """`fedsub --version`, `--help` and the reproduce listing answer without torch's import
    (a second or more of every call): the commands import the engine when they train."""
    code = (
        "import contextlib, io, json, sys\n"
        "import fedsub.cli\n"
        "loaded = {'import fedsub.cli': 'torch' in sys.modules}\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        assert fedsub.cli.main(argv) == 0, argv\n"
        "    loaded[' '.join(argv)] = 'torch' in sys.modules\n"
        "print(json.dumps(loaded))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(QUICK_COMMANDS)],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = json.loads(done.stdout)
    assert not any(loaded.values()), loaded
    assert len(loaded) == 1 + len(QUICK_COMMANDS)


def test_a_repeated_listing_answers_without_torch(tmp_path):
    """`fedsub list KIND` keeps its answer (cli/listing_cache.py, keyed by the installation):
    the first call imports the registries and torch, the next prints the same lines without."""
    code = (
        "import contextlib, io, sys\n"
        "import fedsub.cli\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    assert fedsub.cli.main(['list', sys.argv[1]]) == 0\n"
        "print('torch' in sys.modules)\n"
        "print(out.getvalue(), end='')\n"
    )
    env = {**os.environ, "FEDSUB_CACHE": str(tmp_path)}
    for kind in ("keys", "models"):
        first, again = (
            subprocess.run(
                [sys.executable, "-c", code, kind], capture_output=True, text=True, check=True,
                env=env,
            ).stdout.split("\n", 1)
            for _ in range(2)
        )  # fmt: skip
        assert first[0] == "True" and again[0] == "False", (first[0], again[0])
        assert again[1] == first[1] and again[1].strip()
    assert len(list(tmp_path.glob("list-*.json"))) == 2
