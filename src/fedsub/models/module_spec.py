"""The built-in model ``torch-module``: a user's ``nn.Module`` named in a config file.

A process that gets no Python objects (``fedsub run``, ``torchrun``, a Flower ClientApp or
ServerApp) names the module by where its factory lives, ``module = "package.module:factory"``
(``module_path.py``); the factory's package must be importable there (installed, or its
folder on ``PYTHONPATH``). The factory is called with ``arguments`` as keywords, and with
``dataset=`` (the ``FederatedDataset``: ``table_rows``, ``field_tables``, ``train.dense_dim``)
when it has a parameter of that name, so it can size its tables. It runs under
``torch.manual_seed(init_seed)`` (the global generator restored afterwards): every process
builds the same initial weights. The module is then wrapped as ``fedsub.train`` wraps it
(``torch_module.wrap``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fedsub.data.federated import FederatedDataset
from fedsub.errors import ConfigError
from fedsub.models.module_path import FORMAT, build_module, resolve
from fedsub.models.torch_module import TorchModuleModel, wrap

NAME = "torch-module"
EXPECTED = f"the importable path of a function or class building the nn.Module, {FORMAT}"


def check_path_format(path: str) -> None:
    """The config check of ``module`` (its import happens when the model is built)."""
    module_name, colon, attribute = path.partition(":")
    if not colon or not module_name.strip() or not attribute.strip():
        raise ValueError(f"expected {FORMAT}, e.g. 'my_models:TwoTower'")


@dataclass(frozen=True)
class TorchModuleOptions:
    module: str = field(
        metadata={"validate": check_path_format, "expected": f"{EXPECTED}, e.g. 'my_models:Tower'"}
    )
    """Where the factory of your nn.Module lives, 'package.module:factory' (a class or function;
    'package.module:Class.create' for a classmethod). Its package must be importable by every
    process of the run (installed, or on PYTHONPATH). A factory with a parameter named
    `dataset` gets the loaded dataset (its table_rows, field_tables, train.dense_dim)."""
    arguments: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the factory, a TOML table such as { dim = 8 }."""
    tables: dict[str, str] = field(default_factory=dict)
    """Which embedding module holds which dataset table, { table = "attribute.path" } (as
    fedsub.train's tables=); {} = the embedding modules named after the dataset's tables."""
    init_seed: int = 0
    """torch's seed while the factory runs (its initial weights): every process builds the
    same module."""


def build(dataset: FederatedDataset, options: TorchModuleOptions) -> TorchModuleModel:
    """The module the factory builds for ``dataset``, wrapped (``torch_module.wrap``)."""
    arguments = dict(options.arguments)
    if _takes_dataset(resolve(options.module)):
        arguments["dataset"] = dataset
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.init_seed)
        try:
            module = build_module(options.module, **arguments)
        except TypeError as error:
            given = ", ".join(sorted(options.arguments)) or "none"
            raise ConfigError(
                f"model.module = {options.module!r}: calling it with model.arguments "
                f"({given}) failed: {error}"
            ) from error
    return wrap(module, dataset, tables=dict(options.tables) or None)


def _takes_dataset(factory: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: it takes no dataset
        return False
    found = parameters.get("dataset")
    return found is not None and found.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
