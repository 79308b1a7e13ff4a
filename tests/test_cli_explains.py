"""The command line explains itself: --version, `fedsub list`, help texts with examples,
errors that name the --set at fault, a fetch listing readable at 80 columns."""

from __future__ import annotations

import dataclasses

import pytest

from fedsub import __version__
from fedsub import config as config_lib
from fedsub.algorithms.registry import algorithm_names, options_class
from fedsub.algorithms.schemes import SCHEMES
from fedsub.cli import build_parser, catalog, main
from fedsub.data.fetch import DOWNLOADS, listing
from fedsub.data.registry import DATASETS
from fedsub.keys import key_names
from fedsub.models.registry import model_names, model_spec


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's --help / --version
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_version(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0
    assert out.strip() == f"fedsub {__version__}"


def test_list_algorithms_names_every_algorithm_option_and_scheme(capsys):
    code, out, _ = run_cli(capsys, "list", "algorithms")
    assert code == 0
    for name in algorithm_names():
        assert f"\n{name}: " in out
        for field in dataclasses.fields(options_class(name)):
            assert f"algorithms.{name}.{field.name}: " in out
    for scheme in SCHEMES:
        assert scheme in out
    assert "fedprox: FedAvg with (mu/2)" in out  # the registry's own description


def test_list_datasets_names_every_dataset_and_its_options_with_defaults(capsys):
    code, out, _ = run_cli(capsys, "list", "datasets")
    assert code == 0
    for name, spec in DATASETS.items():
        assert f"\n{name}: {spec.description.split()[0]}" in out
        block = out.split(f"\n{name}: ", 1)[1].split("\n\n", 1)[0]
        for field in dataclasses.fields(spec.options):
            line = next(li for li in block.splitlines() if f"data.{field.name}: " in li)
            default = field.default if field.default is not dataclasses.MISSING else None
            if isinstance(default, int | float) and not isinstance(default, bool):
                assert f"default {default!r}" in line


def test_list_models_matches_the_registry_and_model_config(capsys):
    code, out, _ = run_cli(capsys, "list", "models")
    assert code == 0
    for name in model_names():
        spec = model_spec(name)
        assert f"\n{name}: {spec.description}" in out
        block = out.split(f"\n{name}: ", 1)[1].split("\n\n", 1)[0]
        for field in dataclasses.fields(spec.options):
            assert f"  model.{field.name}: " in block
        capabilities = block.split("capabilities: ", 1)[1].split("\n  model.")[0]
        assert ("sliceable" in capabilities) == spec.sliceable
    assert "model.widths: a list of an integer, default []" in out


def test_list_keys_shows_every_config_key_default_and_allowed_values(capsys):
    code, out, _ = run_cli(capsys, "list", "keys")
    assert code == 0
    for section, cls in config_lib.SECTIONS.items():
        if cls is None:
            continue
        for key in key_names(cls):  # a group's keys (fedsub/keys.py) are the section's own
            assert f"  {section}.{key}: " in out
    assert "train.lr: a number, default 0.1, > 0.0" in out
    assert "dp.clip_lr: a number, default 0.2, > 0.0" in out
    assert 'execution.backend: a string, default "batched", one of batched, sequential' in out
    assert "eval.target_test_auc: a number (optional), default unset, >= 0.0, <= 1.0" in out
    for name in algorithm_names():
        assert f"algorithms.{name}.lr: " in out


def test_every_listing_fits_80_columns():
    for kind in catalog.KINDS:
        assert max(len(line) for line in catalog.listing(kind)) <= 80, kind


def test_list_refuses_an_unknown_kind(capsys):
    code, _, err = run_cli(capsys, "list", "optimizers")
    assert code == 2
    assert "invalid choice: 'optimizers'" in err


SUBCOMMANDS = [["run"], ["compare"], ["data", "stats"], ["data", "fetch"], ["list"], ["data"]]


@pytest.mark.parametrize("command", SUBCOMMANDS, ids=" ".join)
def test_every_help_mentions_fedsub_list_and_ends_with_two_examples(capsys, monkeypatch, command):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps option help to the terminal
    code, out, _ = run_cli(capsys, *command, "--help")
    assert code == 0
    assert "fedsub list" in out
    examples = out.rstrip().split("examples:\n", 1)[1].splitlines()
    assert len(examples) == 2
    assert all(line.startswith(f"  fedsub {command[0]}") for line in examples)
    if "--set" in out:
        assert "may be repeated" in out and "read as TOML" in out
    description_and_epilog = out.split("\n\n", 1)[1]
    assert max(len(line) for line in description_and_epilog.splitlines()) <= 80


def test_top_level_help_has_no_rest_markup(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    assert "``" not in out
    assert "``" not in (build_parser().description or "")
    assert max(len(line) for line in (build_parser().description or "").splitlines()) <= 80


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        (["train.rounds=3", "train.lr=abc"], "--set train.lr=abc: train.lr must be a number"),
        (["train.lr=-1"], "--set train.lr=-1: train.lr = -1.0 is out of range"),
        (["masking.scheme=static"], "--set masking.scheme=static: masking.scheme = 'static'"),
        (["data.num_users=1"], "--set data.num_users=1: data.num_users = 1 is out of range"),
    ],
)
def test_a_bad_set_value_is_named_not_the_default_config(capsys, sets, named):
    argv = ["compare", "--quiet"] + [a for s in sets for a in ("--set", s)]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.startswith(f"fedsub: error: {named}")
    assert "default config" not in err


def test_an_error_in_the_file_names_the_file_even_with_sets(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nlr = -2\n")
    code, _, err = run_cli(capsys, "compare", str(path), "--set", "train.rounds=3")
    assert code == 2
    assert err.startswith(f"fedsub: error: {path}: train.lr = -2")


def test_fetch_listing_fits_80_columns_and_names_every_file():
    lines = listing()
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    for name, downloads in DOWNLOADS.items():
        assert f"\n{name}" in text
        for download in downloads:
            assert f"  {download.filename}  " in text
    assert "no checksum published" in text  # amazon-electronics has no public pin


def test_a_bad_sweep_value_names_the_sweep(capsys):
    code, _, err = run_cli(capsys, "compare", "--quiet", "--sweep", "train.lr=0.1,abc")
    assert code == 2
    assert err.startswith(
        "fedsub: error: --sweep train.lr=0.1,abc: value abc: train.lr must be a number"
    )
    code, _, err = run_cli(capsys, "compare", "--quiet", "--sweep", "train.lr=0.2,0.1,0.2")
    assert code == 2
    assert err.startswith("fedsub: error: --sweep 'train.lr=0.2,0.1,0.2': value '0.2' is given")


def test_a_closed_pipe_ends_the_listing_without_a_traceback():
    """`fedsub list keys | head -1`: the reader has gone before fedsub writes."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader: every write gets EPIPE
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fedsub.cli", "list", "keys"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 141
    assert done.stderr == ""
