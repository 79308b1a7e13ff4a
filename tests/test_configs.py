"""Every shipped config file loads and validates."""

from pathlib import Path

import pytest

from fedsub import config as config_lib

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_validates(path):
    config = config_lib.load(path)
    assert config.train.algorithms
