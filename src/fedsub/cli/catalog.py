"""``fedsub list algorithms|datasets|models|keys``: what can be configured, generated from the
registries and the config dataclasses (so it cannot drift from what the parser accepts)."""

from __future__ import annotations

import dataclasses
import re
import textwrap
import types
import typing
from typing import Any

from fedsub import config as config_lib
from fedsub import plugins
from fedsub.algorithms import registry as algorithm_registry
from fedsub.algorithms.aggregation_rules import AGGREGATIONS, AggregationRule, aggregation_names
from fedsub.algorithms.schemes import SCHEMES
from fedsub.client.transforms import TRANSFORMS
from fedsub.data.registry import DATASETS, dataset_names
from fedsub.keys import section_fields, type_name
from fedsub.models.registry import MODELS, model_names, model_spec
from fedsub.plugins import BUILT_IN, Registry

KINDS = ("algorithms", "datasets", "models", "keys")
WIDTH = 80


def describe_field(cls: type, field: dataclasses.Field) -> str:
    """ "a number, default 0.1, > 0" for one config field: type, default, allowed values."""
    hint = typing.get_type_hints(cls)[field.name]
    parts = [type_name(hint)]
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    if optional and type(None) in typing.get_args(hint):
        parts[0] += " (optional)"
    parts.append(f"default {_default_text(field)}")
    meta = field.metadata
    if "choices" in meta:
        parts.append("one of " + ", ".join(meta["choices"]()))
    if "min" in meta:
        parts.append(f">= {meta['min']}")
    if "min_exclusive" in meta:
        parts.append(f"> {meta['min_exclusive']}")
    if "max" in meta:
        parts.append(f"<= {meta['max']}")
    if "max_exclusive" in meta:
        parts.append(f"< {meta['max_exclusive']}")
    if "algorithm_names" in meta:
        parts.append("algorithm names, each optionally @scheme")
    if meta.get("nonempty"):
        parts.append("not empty")
    return ", ".join(parts)


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value: Any = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    return "unset" if value is None else config_lib.toml_value(value)


def _key_lines(cls: type, prefix: str, indent: str = "  ") -> list[str]:
    lines = []
    for owner, f in section_fields(cls):
        head = f"{indent}{prefix}{f.name}: "
        lines += textwrap.wrap(
            describe_field(owner, f),
            WIDTH,
            initial_indent=head,
            subsequent_indent=indent + "    ",
        )
    return lines


def _wrapped(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")


def algorithm_descriptions() -> dict[str, str]:
    """Each algorithm's line in the registry's docstring ("- ``name``: what it does")."""
    found: dict[str, str] = {}
    bullets = re.split(r"\n(?=- ``)", algorithm_registry.__doc__ or "")
    for bullet in bullets:
        if not bullet.startswith("- ``"):
            continue
        head, _, text = bullet.partition(": ")
        text = " ".join(text.split("\n\n")[0].split())
        for name in re.findall(r"``([^`]+)``", head):
            found[name] = text.replace("``", "")
    return found


def algorithms() -> list[str]:
    descriptions = algorithm_descriptions()
    lines = ["Algorithms (train.algorithms; options in [algorithms.<name>]):"]
    for name in algorithm_registry.algorithm_names():
        lines.append("")
        lines += _wrapped(f"{name}: {descriptions.get(name, '')}".rstrip(": "))
        lines += _wrapped(f"= {algorithm_registry.PRESETS[name].recipe.describe()}", "  ")
        lines += _key_lines(algorithm_registry.options_class(name), f"algorithms.{name}.")
    lines += [""]
    lines += _wrapped(
        "Schemes (Li et al.), as name@scheme, e.g. fedavg@scheme1: " + ", ".join(SCHEMES)
    )
    return [*lines, "", *pieces()]


def _first_sentence(cls: type) -> str:
    text = " ".join((cls.__doc__ or "").split()).replace("``", "")
    return text.split(". ")[0].rstrip(".")


def _rule_properties(rule: type[AggregationRule]) -> str:
    """An aggregation rule's declarations, as the checks read them."""
    said = [
        "pools the data" if rule.pools_data else "",
        "reads the heat" if rule.needs_heat else "",
        "a weighted sum (secure sums, masking)" if rule.secure_sum_ok else "its own combine step",
        "" if rule.weights_sum_to_one else "weights not summing to 1",
    ]
    return "(" + "; ".join(s for s in said if s) + ")"


def pieces() -> list[str]:
    """The pieces an algorithm is composed of, each with its options (config keys of
    ``[algorithms.<name>]`` when the algorithm uses that piece)."""
    registry = algorithm_registry
    lines = _wrapped(
        "Pieces: compose an algorithm in [algorithms.<name>] with aggregation = ..., "
        "client = [...], server = ... and the chosen pieces' options (lr for every one):"
    )
    lines += ["", "aggregation (default fedavg):"]
    for name in aggregation_names():
        rule = AGGREGATIONS[name]
        lines += _named(name, rule.description, AGGREGATIONS, "  ")
        lines += _wrapped(_rule_properties(rule), "    ")
        lines += _key_lines(rule, "", "    ")
    lines += ["", "client (a list; train.clip_norm / weight_decay / momentum add theirs):"]
    for name in registry.client_piece_names():
        cls = TRANSFORMS[name]
        lines += _named(name, _first_sentence(cls), TRANSFORMS, "  ")
        lines += _key_lines(cls, "", "    ") or ["    (no options)"]
    lines += ["", "server (default sgd):"]
    for name, server in registry.SERVERS.items():
        lines += _named(name, server.description, registry.SERVERS, "  ")
        lines += _key_lines(server.options, "", "    ")
    return lines


def _named(name: str, text: str, registry: Registry[Any], indent: str = "") -> list[str]:
    """The lines "name: text", then the plugin it came from (built-in entries: none)."""
    origin = registry.origin(name)
    lines = _wrapped(f"{name}: {text}", indent)
    return lines if origin == BUILT_IN else [*lines, *_wrapped(f"[{origin}]", indent + "  ")]


def datasets() -> list[str]:
    lines = ["Datasets (data.name; their options are further [data] keys):"]
    for name in dataset_names():
        spec = DATASETS[name]
        lines.append("")
        lines += _named(name, spec.description, DATASETS)
        lines += _key_lines(spec.options, "data.")
    return lines


def models() -> list[str]:
    lines = ["Models (model.name; options are further [model] keys):"]
    for name in model_names():
        spec = model_spec(name)
        lines.append("")
        lines += _named(name, spec.description, MODELS)
        lines += textwrap.wrap(
            f"reads {spec.reads.describe()}",
            WIDTH,
            initial_indent="  ",
            subsequent_indent="    ",
        )
        capabilities = ", ".join(spec.capabilities()) or "none"
        lines += _wrapped(f"capabilities: {capabilities}", "  ")
        lines += _key_lines(spec.options, "model.") or ["  (no options)"]
    return lines


def keys() -> list[str]:
    lines = ["Config keys (TOML sections, or --set section.key=value):"]
    for section, cls in config_lib.SECTIONS.items():
        if cls is None:
            continue
        lines += ["", f"[{section}]"]
        lines += _key_lines(cls, f"{section}.")
        if section == "data":
            lines.append("  + the dataset's own options: `fedsub list datasets`")
        if section == "model":
            lines.append("  + the model's own options: `fedsub list models`")
    lines += ["", "[algorithms.<name>]"]
    for name in algorithm_registry.algorithm_names():
        lines += _key_lines(algorithm_registry.options_class(name), f"algorithms.{name}.")
    lines.append("  + a composed algorithm's pieces and options: `fedsub list algorithms`")
    return lines


def plugin_problems() -> list[str]:
    """One line per plugin that could not be used (its package, entry point and why), after
    every registry has taken its plugins' objects; empty when all loaded."""
    return [str(problem) for problem in plugins.problems()]


def listing(kind: str) -> list[str]:
    """The lines of ``fedsub list KIND``."""
    return {"algorithms": algorithms, "datasets": datasets, "models": models, "keys": keys}[kind]()
