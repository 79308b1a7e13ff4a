"""Algorithms a user composes in the config, from the pieces of fedsub.algorithms.registry::

    [algorithms.my-algo]
    aggregation = "fedsubavg"     # fedavg | fedsubavg | central (algorithms/aggregation_rules.py)
    client = ["prox"]             # client transforms by name (fedsub.client.transforms)
    server = "adam"               # sgd | momentum | adam | adagrad | yogi
    mu = 0.01                     # options of the chosen pieces, and lr

The table's other keys are the options of exactly the chosen pieces: each piece's options
dataclass (an aggregation rule's or a client transform's own fields, a server piece's
``options``) contributes its fields, so an option of a piece the algorithm does not use is an
unknown key.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

from fedsub.algorithms.aggregation_rules import AGGREGATIONS, aggregation_names, rule_class
from fedsub.algorithms.registry import (
    PRESETS,
    SERVERS,
    CommonOptions,
    Composed,
    Recipe,
    check_combination,
    client_piece_names,
)
from fedsub.client.transforms import TRANSFORMS
from fedsub.errors import ConfigError

RECIPE_KEYS = ("aggregation", "client", "server")


def piece_option_classes(recipe: Recipe) -> list[tuple[str, type]]:
    """(piece label, options dataclass) of each chosen piece, in the order options are listed."""
    rule = (f"aggregation {recipe.aggregation!r}", rule_class(recipe.aggregation))
    pieces = [(f"client piece {n!r}", TRANSFORMS[n]) for n in recipe.client]
    return [rule, *pieces, (f"server {recipe.server!r}", SERVERS[recipe.server].options)]


@functools.cache
def options_class_of(recipe: Recipe) -> type:
    """The options dataclass of a composed algorithm: ``lr`` and the chosen pieces' options."""
    fields: list[tuple[str, Any, Any]] = []
    owner: dict[str, str] = {"lr": "every algorithm"}
    for cls, label in [(CommonOptions, "every algorithm")] + [
        (c, label) for label, c in piece_option_classes(recipe)
    ]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in owner and owner[f.name] != label:
                raise ConfigError(
                    f"option {f.name!r} belongs to both {owner[f.name]} and {label}; "
                    "these pieces cannot be combined"
                )
            owner[f.name] = label
            fields.append(
                (f.name, hints[f.name], dataclasses.field(default=f.default, metadata=f.metadata))
            )
    return dataclasses.make_dataclass("ComposedOptions", fields, frozen=True)


def _option_owners() -> dict[str, list[str]]:
    """Every option key of every piece -> the pieces that take it (for error messages)."""
    owners: dict[str, list[str]] = {}
    for name, rule in AGGREGATIONS.items():
        for f in dataclasses.fields(rule):
            owners.setdefault(f.name, []).append(f"aggregation {name!r}")
    for name in client_piece_names():
        for f in dataclasses.fields(TRANSFORMS[name]):
            owners.setdefault(f.name, []).append(f"client piece {name!r}")
    for name, piece in SERVERS.items():
        for f in dataclasses.fields(piece.options):
            owners.setdefault(f.name, []).append(f"server {name!r}")
    return owners


def _choice(where: str, value: Any, choices: list[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{where} = {value!r} is not allowed; choose from {', '.join(choices)}")
    return value


def parse_recipe(name: str, table: dict[str, Any]) -> Recipe:
    """The pieces named in ``[algorithms.<name>]`` (ConfigError naming the key otherwise)."""
    where = f"algorithms.{name}"
    if name in PRESETS:
        raise ConfigError(
            f"[{where}] is a preset ({PRESETS[name].recipe.describe()}); its pieces are fixed. "
            f"Give your own composition another name, e.g. [algorithms.my-{name}]"
        )
    if "@" in name or not name:
        raise ConfigError(f"[{where}]: an algorithm's name must not be empty or contain '@'")
    aggregation = _choice(
        f"{where}.aggregation", table.get("aggregation", "fedavg"), aggregation_names()
    )
    client = table.get("client", [])
    if not isinstance(client, list):
        raise ConfigError(f"{where}.client must be a list of strings, got {client!r}")
    pieces = tuple(_choice(f"{where}.client", c, client_piece_names()) for c in client)
    server = _choice(f"{where}.server", table.get("server", "sgd"), sorted(SERVERS.keys()))
    return Recipe(aggregation, pieces, server)


def parse_composed(name: str, table: dict[str, Any], parse_section: Any) -> Composed:
    """``[algorithms.<name>]`` with aggregation / client / server keys as a ``Composed``;
    ``parse_section`` validates the options (config.parse_section)."""
    recipe = parse_recipe(name, table)
    check_combination(name, recipe)  # pieces that never combine, whether listed or not
    options = {k: v for k, v in table.items() if k not in RECIPE_KEYS}
    cls = options_class_of(recipe)
    allowed = {f.name for f in dataclasses.fields(cls)}
    owners = _option_owners()
    for key in sorted(options):
        if key not in allowed and key in owners:
            raise ConfigError(
                f"[algorithms.{name}] key {key!r} is an option of {' and '.join(owners[key])}, "
                f"which {name} does not use ({recipe.describe()}); allowed keys: "
                f"{', '.join([*RECIPE_KEYS, *sorted(allowed)])}"
            )
    context = f" (not an option of {recipe.describe()})"
    return Composed(recipe, parse_section(cls, f"algorithms.{name}", options, context))


def recipe_of(name: str, algorithms: dict[str, Any]) -> Recipe:
    """The pieces of algorithm ``name`` (a preset, or composed in the config's ``algorithms``)."""
    base = name.partition("@")[0]
    defined = algorithms.get(base)
    return defined.recipe if isinstance(defined, Composed) else PRESETS[base].recipe


def composed_table(composed: Composed) -> dict[str, Any]:
    """The ``[algorithms.<name>]`` table that ``parse_composed`` reads back (for to_toml)."""
    recipe = composed.recipe
    table: dict[str, Any] = {"aggregation": recipe.aggregation, "client": list(recipe.client)}
    table["server"] = recipe.server
    table.update(dataclasses.asdict(composed.options))
    return table
