"""A user's module named by an importable path, ``package.module:factory``.

A process that cannot be handed a Python object (a Flower ClientApp, a config file) names the
user's model by where its factory lives; ``build_module`` imports it, calls it and checks
that it gave a ``torch.nn.Module``. The factory is any callable: a class, a function, or an
attribute path inside the module (``package.module:Class.create``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from fedsub.errors import ConfigError

FORMAT = "'package.module:factory'"


def resolve(path: str) -> Callable[..., Any]:
    """The callable at ``path`` (imported; nothing is called)."""
    module_name, colon, attribute = path.partition(":")
    if not colon or not module_name or not attribute:
        raise ConfigError(f"model path {path!r}: expected {FORMAT}, e.g. 'my_models:TwoTower'")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"model path {path!r}: cannot import module {module_name!r} ({error}); is its "
            "package installed, or its folder on PYTHONPATH?"
        ) from error
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise ConfigError(
                f"model path {path!r}: {module_name!r} has no attribute {attribute!r} "
                f"({part!r} is missing)"
            ) from None
    if not callable(found):
        raise ConfigError(
            f"model path {path!r} names a {type(found).__name__}, not a class or function "
            "that builds the module"
        )
    return found


def build_module(path: str, *args: Any, **kwargs: Any) -> nn.Module:
    """The ``nn.Module`` the factory at ``path`` builds from ``args`` and ``kwargs``."""
    module = resolve(path)(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"model path {path!r} built a {type(module).__name__}; expected a torch.nn.Module"
        )
    return module
