"""The docs' generated pages: the config reference from config.py's dataclasses and the
registries (every key, its type, default, allowed values and doc), the keys that moved out of
``[train]`` (moved_keys.py's table), and the CLI reference from ``cli.build_parser()``.

A page holds a marker line (``<!-- generated: config-reference -->``) that the MkDocs hook
``on_page_markdown`` replaces at build time, so nothing here is ever copied by hand and the
reference cannot drift from what the parser accepts. A key's doc is its attribute docstring
(a string right after the field) or, failing that, the comment lines just above the field and
the comment at the end of its line. ``tests/test_docs_examples.py`` imports this module.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import textwrap
import types
import typing
from typing import Any

MARKERS = {
    "<!-- generated: config-reference -->": "config_reference",
    "<!-- generated: cli-reference -->": "cli_reference",
    "<!-- generated: moved-keys -->": "moved_keys_reference",
}


def moved_keys_reference() -> str:
    """The keys that moved out of ``[train]``: moved_keys.py's table, old key -> new place."""
    from fedsub import moved_keys

    return "\n".join(moved_keys.reference_rows())


def field_docs(cls: type) -> dict[str, str]:
    """Each field's doc: its attribute docstring, else its comments (above and at the end)."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    previous_end = body.lineno  # the class line (1-based)
    statements = body.body
    for position, statement in enumerate(statements):
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            name = statement.target.id
            following = statements[position + 1] if position + 1 < len(statements) else None
            if (
                isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[name] = " ".join(following.value.value.split())
            else:
                above = []
                for line in reversed(lines[previous_end : statement.lineno - 1]):
                    if not line.strip().startswith("#"):
                        break
                    above.insert(0, line.strip().lstrip("#").strip())
                first = lines[statement.lineno - 1]
                trailing = first.split("#", 1)[1].strip() if "#" in first else ""
                docs[name] = " ".join(part for part in [*above, trailing] if part)
        previous_end = statement.end_lineno or statement.lineno
    return docs


def _type_text(hint: Any) -> str:
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        args = typing.get_args(hint)
        text = " or ".join(_type_text(a) for a in args if a is not type(None))
        return text + (" (optional)" if type(None) in args else "")
    origin = typing.get_origin(hint)
    if origin is list:
        return f"list of {_type_text(typing.get_args(hint)[0])}"
    names = {bool: "boolean", int: "integer", float: "number", str: "string"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _toml(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "(required)"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _allowed(meta: typing.Mapping[str, Any]) -> str:
    parts = []
    if "choices" in meta:
        parts.append(", ".join(f"`{c}`" for c in meta["choices"]()))
    for key, sign in (("min", ">="), ("min_exclusive", ">"), ("max", "<="), ("max_exclusive", "<")):
        if key in meta:
            parts.append(f"{sign} {meta[key]}")
    if "algorithm_names" in meta:
        parts.append("algorithm names (`fedsub list algorithms`), each optionally `@scheme`")
    if meta.get("nonempty"):
        parts.append("not empty")
    if "validate" in meta:
        parts.append("checked on load")
    return "; ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _docs(cls: type) -> dict[str, str]:
    """The docs of a dataclass's fields, a subclass's doc of a field winning."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update({k: v for k, v in field_docs(base).items() if v})
    return docs


def key_table(cls: type, prefix: str) -> list[str]:
    """A markdown table of a dataclass's config keys (``prefix`` + field name); a group's keys
    (fedsub/keys.py) are the section's own, in the group's place."""
    from fedsub.keys import section_fields

    rows = ["| key | type | default | allowed | what it does |", "|---|---|---|---|---|"]
    for owner, field in section_fields(cls):
        docs = _docs(owner)
        cells = [
            f"`{prefix}{field.name}`",
            _type_text(typing.get_type_hints(owner)[field.name]),
            f"`{_toml(_default(field))}`",
            _allowed(field.metadata),
            docs.get(field.name, ""),
        ]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return rows


def config_reference() -> str:
    """Every section and key the config parser accepts, as markdown."""
    from fedsub import config as config_lib
    from fedsub.algorithms import registry as algorithms
    from fedsub.algorithms.aggregation_rules import AGGREGATIONS, aggregation_names
    from fedsub.algorithms.schemes import SCHEMES
    from fedsub.client.transforms import TRANSFORMS
    from fedsub.data.registry import DATASETS, dataset_names
    from fedsub.models.registry import model_names, model_spec

    out: list[str] = []
    for section, cls in config_lib.SECTIONS.items():
        if cls is None:
            continue
        out += [f"## `[{section}]`", ""]
        doc = inspect.getdoc(cls)
        if doc and not doc.startswith(cls.__name__ + "("):
            out += [doc, ""]
        out += [*key_table(cls, f"{section}."), ""]
        if section == "data":
            out += ["### Each dataset's options (more `[data]` keys)", ""]
            for name in dataset_names():
                spec = DATASETS[name]
                out += [f'#### `data.name = "{name}"`', "", spec.description, ""]
                out += ["More in [Datasets and models](datasets.md).", ""]
                if dataclasses.fields(spec.options):
                    out += [*key_table(spec.options, "data."), ""]
                else:
                    out += ["No options of its own.", ""]
        if section == "model":
            out += ["### Each model: what it reads, and its options (more `[model]` keys)", ""]
            for name in model_names():
                spec = model_spec(name)
                out += [f'#### `model.name = "{name}"`', "", spec.description, ""]
                out += [f"Reads: {spec.reads.describe()}.", ""]
                if dataclasses.fields(spec.options):
                    out += [*key_table(spec.options, "model."), ""]
                else:
                    out += ["No options of its own.", ""]
    out += [
        "## `[algorithms.<name>]`",
        "",
        "One table per algorithm that needs options: a preset's name (its options below) or a "
        "name of your own that composes pieces (`aggregation`, `client`, `server`; then the "
        "chosen pieces' options, and `lr`). A name in `train.algorithms` may carry a scheme: "
        + ", ".join(f"`@{s}`" for s in SCHEMES)
        + ".",
        "",
        "### Presets",
        "",
    ]
    for name in algorithms.algorithm_names():
        recipe = algorithms.PRESETS[name].recipe.describe()
        out += [f"#### `{name}`", "", f"= {recipe}", ""]
        out += [*key_table(algorithms.options_class(name), f"algorithms.{name}."), ""]
    out += ["### Pieces of a composed algorithm", "", "`aggregation` (default `fedavg`):", ""]
    for name in aggregation_names():
        rule = AGGREGATIONS[name]
        out += [f"#### aggregation `{name}`", "", rule.description, ""]
        if dataclasses.fields(rule):
            out += [*key_table(rule, "algorithms.<name>."), ""]
    out += ["", "`client` (a list of client transforms):", ""]
    for name in algorithms.client_piece_names():
        cls = TRANSFORMS[name]
        first = " ".join((inspect.getdoc(cls) or "").split()).split(". ")[0]
        out += [f"#### client `{name}`", "", first.replace("``", "`"), ""]
        if dataclasses.fields(cls):
            out += [*key_table(cls, "algorithms.<name>."), ""]
    out += ["`server` (default `sgd`):", ""]
    for name, server in algorithms.SERVERS.items():
        out += [f"#### server `{name}`", "", server.description, ""]
        if dataclasses.fields(server.options):
            out += [*key_table(server.options, "algorithms.<name>."), ""]
    return "\n".join(out)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    """Every command's ``--help``, from the parser itself."""
    from fedsub import cli

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        out: list[str] = []

        def describe(parser: argparse.ArgumentParser, name: str, level: int) -> None:
            out.extend([f"{'#' * level} `{name}`", "", "```text", parser.format_help().rstrip()])
            out.extend(["```", ""])
            for sub, subparser in _subparsers(parser).items():
                describe(subparser, f"{name} {sub}", min(level + 1, 4))

        describe(cli.build_parser(), "fedsub", 2)
        return "\n".join(out)
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs hook: replace each marker line with its generated markdown."""
    for marker, function in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, globals()[function]())
    return markdown
