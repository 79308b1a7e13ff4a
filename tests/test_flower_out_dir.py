"""The Flower run config's out-dir: results go outside the app folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsub.errors import ConfigError
from fedsub.flower.settings import FlowerSettings


def test_out_dir_expands_home_and_keeps_absolute_paths(tmp_path):
    home = FlowerSettings.from_run_config({"out-dir": "~/fedsub-flower-out"})
    assert home.out_dir == str(Path.home() / "fedsub-flower-out")
    assert FlowerSettings.from_run_config({"out-dir": str(tmp_path)}).out_dir == str(tmp_path)
    assert FlowerSettings.from_run_config({}).out_dir == ""


@pytest.mark.parametrize("relative", ["flower-out", "./results", "../out"])
def test_a_relative_out_dir_is_refused_naming_the_key_and_value(relative):
    with pytest.raises(ConfigError, match=rf"out-dir = '{relative}' is relative"):
        FlowerSettings.from_run_config({"out-dir": relative})


def test_the_example_app_writes_outside_its_folder():
    import tomllib

    example = Path(__file__).parents[1] / "examples" / "flower-fedsubavg"
    config = tomllib.loads((example / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    settings = FlowerSettings.from_run_config(config["config"])
    assert settings.out_dir and not Path(settings.out_dir).is_relative_to(example)
