"""The per-key rules of fedsub's options: a frozen dataclass's annotations (types) and field
metadata (ranges, choices, validators) checked against given values.

One path for every place options come from: config files and ``--set`` (config.py), the
Python API's keyword arguments (library.py, data/from_python.py), and Flower's run and node
configs (``parse_spelled``: flower/settings.py, flower/node_data.py). A ``section`` names the
keys in errors as a config file's (``train.lr``); an empty one names them bare, as keyword
arguments (``lr``).

A field whose type is itself a frozen dataclass is a *group*: a record of keys of the same
section, by concern (``[train]``'s client step, ``[dp]``'s row selection). The TOML table stays
flat: the group's keys are written and read as the section's own (``section_fields``,
``flat_values``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from typing import Any

from fedsub.errors import ArgumentError, ConfigError

KEYWORDS = "\x00keywords"  # parse_section's section while it reads keyword arguments
SPELLED = "\x00spelled"  # parse_section's section while parse_spelled reads a table


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return " or ".join(type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if typing.get_origin(tp) is list:
        return f"a list of {type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        values = typing.get_args(tp)[1]
        return "a table" + ("" if values is Any else f" (each value {type_name(values)})")
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[tp]


def coerce(where: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None:
            return None
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if str not in members and _says_unset(value):
            raise ConfigError(f"{where} = {value!r} is not allowed: {unset_hint(where)}")
        if str in members and isinstance(value, str):
            return value
        numeric = [a for a in members if a is not str]
        if not numeric or isinstance(value, bool) or not isinstance(value, int | float):
            if len(members) == 1:
                return coerce(where, members[0], value)
            raise ConfigError(f"{where} must be {type_name(tp)}, got {value!r}")
        return coerce(where, numeric[0], value)
    if origin is typing.Literal:  # one of the listed values
        if value not in typing.get_args(tp) or isinstance(value, bool):
            raise ConfigError(f"{where} = {value!r} is not allowed; choose {type_name(tp)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be {type_name(tp)}, got {value!r}")
        return [coerce(where, typing.get_args(tp)[0], v) for v in value]
    if origin is dict:  # a TOML table: string keys; values of any kind when typed Any
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be {type_name(tp)}, got {value!r}")
        values = typing.get_args(tp)[1]
        return {
            k: v if values is Any else coerce(f"{where}.{k}", values, v) for k, v in value.items()
        }
    if tp in (int, float) and _numpy_number(value):
        value = value.item()  # a numpy scalar from Python code: judged as the number it holds
    ok = (
        isinstance(value, bool)
        if tp is bool
        else (isinstance(value, tp) and not isinstance(value, bool))
        or (tp is float and isinstance(value, int) and not isinstance(value, bool))
    )
    if not ok:
        raise ConfigError(f"{where} must be {type_name(tp)}, got {value!r}")
    if tp is int and not -(2**63) <= value < 2**63:
        raise ConfigError(f"{where} = {value} does not fit a 64-bit integer (|value| < 2^63)")
    if tp is float and not math.isfinite(float(value) if abs(value) < 2**1000 else math.inf):
        raise ConfigError(f"{where} must be a finite number, got {value!r}")
    return float(value) if tp is float else value


def _says_unset(value: Any) -> bool:
    """Whether a value is a string spelling "not set" (``"none"``: TOML has no null)."""
    return isinstance(value, str) and value.strip().lower() in ("none", "null")


def unset_hint(where: str) -> str:
    """How to leave an optional key unset, for a value that spells "not set" as a string:
    what the key's source allows (a keyword argument: None; a config: no key at all)."""
    if where.startswith(KEYWORDS):
        return "the string 'none' is not None; pass None (or leave the argument out)"
    key = where.removeprefix(f"{SPELLED}.")
    return (
        "the string 'none' is not 'not set' (TOML has no null): leave the key out, or "
        f"--set {key}=none without quotes"
    )


def _numpy_number(value: Any) -> bool:
    """A numpy integer or floating scalar (not a bool)."""
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    return kind in ("i", "u", "f") and getattr(value, "ndim", None) == 0 and hasattr(value, "item")


def check_range(where: str, meta: typing.Mapping[str, Any], value: Any) -> None:
    values = value if isinstance(value, list) else [value]
    if meta.get("nonempty") and not values:
        raise ConfigError(f"{where} must not be empty")
    for v in values:
        if v is None:
            continue
        if "validate" in meta:
            try:
                meta["validate"](v)
            except ValueError as error:
                raise ConfigError(f"{where} = {v!r} is not allowed: {error}") from None
        if "choices" in meta and isinstance(v, str) and v not in (allowed := meta["choices"]()):
            unset = f"; {unset_hint(where)}" if _says_unset(v) else ""
            raise ConfigError(
                f"{where} = {v!r} is not allowed; choose from {', '.join(allowed)}{unset}"
            )
        if isinstance(v, str):
            continue
        if "min" in meta and v < meta["min"]:
            raise ConfigError(f"{where} = {v!r} is out of range; expected >= {meta['min']}")
        if "min_exclusive" in meta and v <= meta["min_exclusive"]:
            raise ConfigError(
                f"{where} = {v!r} is out of range; expected > {meta['min_exclusive']}"
            )
        if "max" in meta and v > meta["max"]:
            raise ConfigError(f"{where} = {v!r} is out of range; expected <= {meta['max']}")
        if "max_exclusive" in meta and v >= meta["max_exclusive"]:
            raise ConfigError(
                f"{where} = {v!r} is out of range; expected < {meta['max_exclusive']}"
            )


def section_fields(cls: type) -> list[tuple[type, dataclasses.Field]]:
    """The keys of a section's dataclass in order, each with the dataclass that declares it (its
    type hints and docs are there): a group's keys in the group's place."""
    hints = typing.get_type_hints(cls)
    keys: list[tuple[type, dataclasses.Field]] = []
    for f in dataclasses.fields(cls):
        if is_group(hints[f.name]):
            keys += section_fields(hints[f.name])
        elif f.name != "options":
            keys.append((cls, f))
    return keys


def key_names(cls: type) -> list[str]:
    """A section's keys, groups' keys included (``section_fields``' names)."""
    return [f.name for _, f in section_fields(cls)]


def flat_values(record: Any) -> dict[str, Any]:
    """A section's keys and values in ``section_fields``' order (a group's in its place)."""
    hints = typing.get_type_hints(type(record))
    values: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if is_group(hints[f.name]):
            values.update(flat_values(value))
        else:
            values[f.name] = value
    return values


def is_group(tp: Any) -> bool:
    """Whether an annotation is a group of keys (a dataclass), not a value."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def parse_section(cls: type, section: str, table: dict[str, Any], context: str = "") -> Any:
    """Build the frozen dataclass ``cls`` from a TOML table, validating every key; each group
    (module docstring) is built from its own keys of the same table.

    ``section`` "" reads ``table`` as keyword arguments: errors name the keys bare, and a
    tuple, or a single string, where a list is expected is taken as that list (a string as
    a one-element list: ``features="item"`` is ``features=["item"]``)."""
    if not section:
        try:
            return parse_section(cls, KEYWORDS, table, context)
        except ConfigError as error:  # the keys named bare, as the caller wrote them
            raise ArgumentError(str(error).replace(f"{KEYWORDS}.", "")) from None
    keywords = section == KEYWORDS
    known = {f.name: (owner, f) for owner, f in section_fields(cls)}
    unknown = sorted(set(table) - set(known), key=str)
    if unknown:
        allowed = ", ".join(known)
        raise ConfigError(
            f"unknown keyword argument {unknown[0]!r}{context}; expected one of {allowed}"
            if keywords
            else f"[{section}] unknown key {unknown[0]!r}{context}; allowed keys: {allowed}"
        )
    missing = [
        (owner, f)
        for owner, f in known.values()
        if f.name not in table
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        owner, key = missing[0]
        expected = key.metadata.get("expected", type_name(typing.get_type_hints(owner)[key.name]))
        lacks = "it is not given" if keywords else f"[{section}] lacks it"
        raise ConfigError(f"{key_name(section, key.name)} is required ({lacks}): {expected}")
    values = {}
    for name, value in table.items():
        owner, f = known[name]
        hint = typing.get_type_hints(owner)[name]
        where = key_name(section, name)
        if keywords:
            value = as_list(hint, value)
        values[name] = coerce(where, hint, value)
        check_range(where, f.metadata, values[name])
    return grouped(cls, values)


def grouped(cls: type, values: dict[str, Any]) -> Any:
    """``cls`` from checked flat key values: each group built from its own keys."""
    hints = typing.get_type_hints(cls)
    own = {}
    for f in dataclasses.fields(cls):
        if is_group(hints[f.name]):
            own[f.name] = grouped(hints[f.name], values)
        elif f.name in values:
            own[f.name] = values[f.name]
    return cls(**own)


def parse_spelled(
    cls: type, where: str, table: Mapping[str, Any], apart: Mapping[str, str] | None = None
) -> Any:
    """``cls`` from a table whose keys are its fields spelled with ``-`` for ``_`` (Flower's
    run and node configs), groups' keys flat among them, errors naming them so (``where:
    min-replies ...``); a number or flag given as text (a command line's) is the TOML value
    it spells (``"true"``, ``"3"``). ``apart`` maps keys the caller reads itself to the field
    each fills (the run config's ``set`` fills ``overrides``): allowed, and left to it."""
    apart = apart or {}
    fields = {
        f.name: typing.get_type_hints(owner)[f.name]
        for owner, f in section_fields(cls)
        if f.name not in apart.values()
    }
    values = {}
    for key, value in table.items():
        name = str(key).replace("-", "_")
        if key in apart:
            continue
        if name not in fields:
            allowed = ", ".join(sorted([*map(spelled, fields), *apart]))
            raise ConfigError(f"{where}: unknown key {key!r}; allowed keys: {allowed}")
        if isinstance(value, str) and fields[name] in (bool, int, float):
            with contextlib.suppress(tomllib.TOMLDecodeError):  # else coerce refuses the text
                value = tomllib.loads(f"v = {value}")["v"]
        values[name] = value
    try:
        return parse_section(cls, SPELLED, values)
    except ConfigError as error:
        text = str(error).replace(f"[{SPELLED}] lacks it", "not given")
        if SPELLED not in text:  # the record's own rule (its __post_init__): said already
            raise
        text = re.sub(rf"{SPELLED}\.(\w+)", lambda m: spelled(m[1]), text)
        raise ConfigError(f"{where}: {text}") from None


def check_spelled(where: str, record: Any) -> None:
    """The ranges of a record built in code (its groups' too), its keys named as
    ``parse_spelled`` names them: the checks a run config's values get."""
    values = flat_values(record)
    for _, f in section_fields(type(record)):
        check_range(f"{where}: {spelled(f.name)}", f.metadata, values[f.name])


def spelled(name: str) -> str:
    """A field's key as Flower's configs write it: ``min_replies`` is ``min-replies``."""
    return name.replace("_", "-")


def key_name(section: str, key: str) -> str:
    """How errors name a key: ``train.lr`` in a config file, ``lr`` as a keyword argument."""
    return f"{section}.{key}" if section else key


def as_list(tp: Any, value: Any) -> Any:
    """A keyword argument's tuple, or single string, as the list annotation ``tp`` expects
    (anything else unchanged, for ``coerce`` to judge)."""
    if typing.get_origin(tp) is not list:
        return value
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, str) and typing.get_args(tp)[0] is str:
        return [value]
    return value
