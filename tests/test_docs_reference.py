"""The generated references (docs/hooks/generated_reference.py) hold every config key the
parser accepts and every command the CLI has.

The keys are taken from the parser's own output (``config.to_toml`` of parsed configs: every
section, every dataset's options, every algorithm preset's options), not from the dataclasses
the generator walks, so a key the generator missed fails here."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

from fedsub import config as config_lib
from fedsub.algorithms.registry import algorithm_names
from fedsub.cli import commands as cli
from fedsub.data.registry import dataset_names
from fedsub.models.registry import model_names

from .torch_modules import ANY_DATA

HOOK = Path(__file__).resolve().parents[1] / "docs" / "hooks" / "generated_reference.py"


def _generator():
    spec = importlib.util.spec_from_file_location("generated_reference", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference() -> str:
    return _generator().config_reference()


def accepted_keys(raw: dict) -> set[str]:
    """``section.key`` for every key of the parsed config's TOML (``[algorithms.<name>]``
    keys as ``algorithms.<name>.key``)."""
    resolved = tomllib.loads(config_lib.to_toml(config_lib.parse(raw)))
    keys = set()
    for section, table in resolved.items():
        for key, value in table.items():
            if section == "algorithms":
                keys.update(f"algorithms.{key}.{option}" for option in value)
            else:
                keys.add(f"{section}.{key}")
    return keys


def documented(reference: str) -> set[str]:
    return set(re.findall(r"^\| `([a-z_<>.\-0-9]+)` \|", reference, flags=re.MULTILINE))


def test_every_key_of_every_dataset_is_in_the_reference(reference):
    keys = set()
    for name in dataset_names():
        keys |= accepted_keys({"data": {"name": name}})
    missing = keys - documented(reference)
    assert not missing, f"not in the config reference: {sorted(missing)}"


def test_every_key_of_every_model_is_in_the_reference(reference):
    keys = set()
    required = {"torch-module": {"module": ANY_DATA}}  # keys without a default
    for name in model_names():
        keys |= accepted_keys({"model": {"name": name, **required.get(name, {})}})
    assert any(k.startswith("model.") and k != "model.name" for k in keys)
    missing = keys - documented(reference)
    assert not missing, f"not in the config reference: {sorted(missing)}"


def test_every_algorithm_option_is_in_the_reference(reference):
    names = algorithm_names()
    raw = {"algorithms": {name: {"lr": 0.1} for name in names}}
    keys = {k for k in accepted_keys(raw) if k.startswith("algorithms.")}
    assert {k.split(".")[1] for k in keys} == set(names)  # every preset takes lr
    missing = keys - documented(reference)
    assert not missing, f"not in the config reference: {sorted(missing)}"


def test_every_key_says_what_it_does(reference):
    """A key's doc is its field's attribute docstring (or comment): a new key needs one."""
    rows = [row for row in reference.splitlines() if re.match(r"^\| `[a-z]", row)]
    assert len(rows) > 100
    undocumented = sorted({row.split("`")[1] for row in rows if row.rstrip().endswith("|  |")})
    assert not undocumented, (
        f"config keys without a doc (give the field an attribute docstring): {undocumented}"
    )


def test_the_cli_reference_holds_every_command():
    text = _generator().cli_reference()
    parser = cli.build_parser()
    commands = _generator()._subparsers(parser)
    assert commands
    for name, sub in commands.items():
        assert f"## `fedsub {name}`" in text
        for subname in _generator()._subparsers(sub):
            assert f"`fedsub {name} {subname}`" in text
    assert "--sweep" in text and "--profile" in text
