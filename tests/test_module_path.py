"""A user's module named by an importable path (fedsub.models.module_path): imported, built,
checked, and every mistake named."""

from __future__ import annotations

import pytest
from torch import nn

from fedsub.errors import ConfigError
from fedsub.models.module_path import build_module, resolve

PACKAGE = """
from torch import nn


class Tower(nn.Module):
    def __init__(self, rows=5):
        super().__init__()
        self.item = nn.EmbeddingBag(rows, 2)

    @classmethod
    def small(cls):
        return cls(3)


def not_a_module():
    return 42


CONSTANT = 7
"""


@pytest.fixture
def towers(tmp_path, monkeypatch):
    (tmp_path / "user_towers").mkdir()
    (tmp_path / "user_towers" / "__init__.py").write_text("")
    (tmp_path / "user_towers" / "models.py").write_text(PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_towers.models"


def test_a_class_a_classmethod_and_arguments_build_the_module(towers):
    module = build_module(f"{towers}:Tower", rows=4)
    assert isinstance(module, nn.Module) and module.item.num_embeddings == 4
    assert build_module(f"{towers}:Tower.small").item.num_embeddings == 3
    assert resolve(f"{towers}:Tower").__name__ == "Tower"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("user_towers.models.Tower", "expected 'package.module:factory'"),
        (":Tower", "expected 'package.module:factory'"),
        ("user_towers.missing:Tower", "cannot import module 'user_towers.missing'"),
        ("user_towers.models:Towr", "'user_towers.models' has no attribute 'Towr'"),
        ("user_towers.models:Tower.big", "has no attribute 'Tower.big' .'big' is missing."),
        ("user_towers.models:CONSTANT", "names a int, not a class or function"),
        ("user_towers.models:not_a_module", "built a int; expected a torch.nn.Module"),
    ],
)
def test_every_mistake_is_named(towers, path, message):
    with pytest.raises(ConfigError, match=message):
        build_module(path)
