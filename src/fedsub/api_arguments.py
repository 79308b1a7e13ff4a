"""The Python API's argument checks that are not config keys (library.py): the shapes of
``model_options``, ``tables``, callbacks, folders and flags, and the terms errors use.

Config keys given as keyword arguments are checked by config.py's rules (one path with config
files); what is checked here is what only Python callers can get wrong: a list where a dict
belongs, a string where a callable does. Every refusal is an ``ArgumentError`` naming the
argument as the caller wrote it, its value and what is expected.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedsub import moved_keys
from fedsub.config import DataConfig, EvalConfig, TrainConfig
from fedsub.data.registry import DATASETS
from fedsub.errors import ArgumentError
from fedsub.keys import key_names
from fedsub.models.registry import model_names, model_spec
from fedsub.runs.tracking import RunCallback
from fedsub.vocabulary import RUN_FLAGS, section_terms


def described(value: Any) -> str:
    """A value as an error shows it: its repr, cut short, and its type."""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} (a {type(value).__name__})"


def names(value: Any, argument: str) -> list[str]:
    """A list of names (``algorithms``): a list or tuple of strings, or one string, taken as
    a one-element list (``algorithms="fedavg"`` is ``algorithms=["fedavg"]``)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ArgumentError(
            f"{argument} must be a list of names such as ['fedavg', 'fedsubavg'], got "
            f"{described(value)}"
        )
    return list(value)


def mapping(value: Any, argument: str, example: str) -> dict[str, Any]:
    """A dict argument (None: empty) with string keys."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ArgumentError(
            f"{argument} must be a dict with string keys, e.g. {example}, got {described(value)}"
        )
    return dict(value)


def tables_of(algorithm_options: Any) -> dict[str, dict[str, Any]]:
    """``algorithm_options``: algorithm name -> a dict of its options."""
    example = "{'fedprox': {'mu': 0.1}}"
    outer = mapping(algorithm_options, "algorithm_options", example)
    return {
        name: mapping(table, f"algorithm_options[{name!r}]", "{'mu': 0.1}")
        for name, table in outer.items()
    }


def callback(value: Any, argument: str, signature: str, arity: int) -> Any:
    """A callable argument taking ``arity`` positional arguments, or None."""
    if value is None:
        return None
    if not callable(value) or not _takes(value, arity):
        raise ArgumentError(
            f"{argument} must be a function {signature} or None, got {described(value)}"
        )
    return value


def _takes(function: Callable[..., Any], arity: int) -> bool:
    """Whether ``function`` can be called with ``arity`` positional arguments (True when
    Python cannot tell: a builtin without a signature)."""
    try:
        inspect.signature(function).bind(*[None] * arity)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def flag(value: Any, argument: str) -> bool:
    if not isinstance(value, bool):
        raise ArgumentError(f"{argument} must be True or False, got {described(value)}")
    return value


def folder(value: Any, argument: str) -> str | None:
    """A folder argument (``out``): a str or os.PathLike, or None."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ArgumentError(
            f"{argument} must be a folder (a str or pathlib.Path), got {described(value)}"
        )
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():
        raise ArgumentError(
            f"{argument} must name a folder, e.g. {argument}='runs/NAME', got {described(value)}"
        )
    return text


def model_file(value: Any, argument: str) -> str | None:
    """A model file argument (``initial_model``): a str or os.PathLike naming a file, or
    None. Whether it is a model file of the run's model is checked when the run starts."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ArgumentError(
            f"{argument} must be a model file (a str or pathlib.Path naming a "
            f"model.safetensors fedsub wrote), got {described(value)}"
        )
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():
        raise ArgumentError(
            f"{argument} must name a model file, e.g. {argument}='runs/NAME/fedsubavg/"
            f"model.safetensors', got {described(value)}"
        )
    return text


def model_options_of(model: str, options: dict[str, Any]) -> None:
    """``model_options`` name only options of built-in model ``model`` (a config file's
    ``[model]`` also accepts, and ignores, keys older models took; a keyword argument is
    never such a leftover, so it is refused instead of ignored)."""
    if model not in model_names():
        return  # config.py names the unknown model
    own = [f.name for f in dataclasses.fields(model_spec(model).options)]
    for key in options:
        if key not in own:
            raise ArgumentError(
                f"model_options[{key!r}]: model {model!r} has no option {key!r}; its options: "
                f"{', '.join(own) or 'none'}"
            )


def train_terms(algorithms: str = "algorithms") -> dict[str, str]:
    """How errors name what ``fedsub.train`` / ``fedsub.compare`` took: keyword arguments
    for the ``[train]`` / ``[eval]`` keys, ``model_options[...]`` and
    ``algorithm_options[...]`` for the ``[model]`` and ``[algorithms.<name>]`` ones."""
    return {
        r"--set eval\.(\w+)=none": r"\1=None",
        r"train\.algorithms": algorithms,
        r"model\.name": "model",
        r"algorithms\.([\w@-]+)\.(\w+)": r"algorithm_options['\1']['\2']",
        r"\[algorithms\.([\w@-]+)\] unknown key": r"algorithm_options['\1']: unknown key",
        r"\[model\] unknown key": "model_options: unknown key",
        **moved_terms(),
        **section_terms("train", key_names(TrainConfig)),
        **section_terms("eval", key_names(EvalConfig)),
        **section_terms("model", _model_keys(), "model_options['{key}']"),
        **RUN_FLAGS,
    }


def moved_terms() -> dict[str, str]:
    """The ``[execution]`` / ``[privacy]`` / ``[masking]`` keys named as the keyword
    arguments that set them (``execution.dtype`` -> ``dtype``, ``masking.scheme`` ->
    ``masking``: moved_keys.py's table)."""
    return {
        rf"{re.escape(section)}\.{re.escape(key)}": old
        for old, (section, key) in moved_keys.MOVED.items()
    }


def data_terms() -> dict[str, str]:
    """How ``load_dataset``'s errors name its keyword arguments: ``data.num_users`` ->
    ``num_users`` (every dataset's options, plugins' included)."""
    keys = set(_fields(DataConfig))
    for name in DATASETS.names():
        keys |= set(_fields(DATASETS.get_or_refuse(name).options))
    return section_terms("data", keys)


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _model_keys() -> set[str]:
    return {key for name in model_names() for key in _fields(model_spec(name).options)}


def run_callbacks(stop_requested: Any, on_round: Any) -> tuple[Callable[[], bool], Any]:
    """``run`` / ``sweep``'s callbacks, checked; a missing ``stop_requested`` never stops."""
    stop = callback(stop_requested, "stop_requested", "() -> bool", 0)
    callback(on_round, "on_round", "(algorithm, round) -> None", 2)
    return stop or (lambda: False), on_round


def tracking_callbacks(callbacks: Any) -> tuple[RunCallback, ...]:
    """``callbacks=[...]``, checked: after-round hooks (``fedsub.RunCallback`` objects:
    ``TensorBoardWriter``, ``MlflowWriter`` or your subclass); None: none."""
    if callbacks is None:
        return ()
    if isinstance(callbacks, RunCallback):
        raise ArgumentError(
            "callbacks must be a list of fedsub.RunCallback objects: give "
            f"[{type(callbacks).__name__}(...)]"
        )
    if isinstance(callbacks, (str, bytes, Mapping)) or not isinstance(callbacks, Sequence):
        raise ArgumentError(
            "callbacks must be a list of fedsub.RunCallback objects (fedsub.TensorBoardWriter, "
            f"fedsub.MlflowWriter or your subclass), got {described(callbacks)}"
        )
    for index, entry in enumerate(callbacks):
        if not isinstance(entry, RunCallback):
            raise ArgumentError(
                f"callbacks[{index}] must be a fedsub.RunCallback (fedsub.TensorBoardWriter, "
                f"fedsub.MlflowWriter or your subclass), got {described(entry)}"
            )
    return tuple(callbacks)
