"""fedsub's packages form layers, and nothing imports upwards: no import cycles.

Every module under src/fedsub is parsed with ``ast`` (nothing is imported). A package is
``fedsub.<name>`` (a folder, or a single module such as ``fedsub.config``). Checked:

- the package graph, from every import (module level, inside functions, under
  ``TYPE_CHECKING``), is acyclic and each import goes to the same or a lower layer of
  ``LAYERS``; a new package must be given a layer here;
- the module graph of the imports that run when a module is imported (module level, not
  under ``TYPE_CHECKING``) is acyclic, so no module ever sees a half-initialized one.

Imports inside functions are allowed when they respect the layers: the command line defers
heavy imports (torch, the experiment) until a command needs them, so ``fedsub --help`` is fast.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "fedsub"

# Lowest first. A package may import from its own layer or any lower one, never a higher one.
LAYERS: list[set[str]] = [
    {
        "fedsub",
        "errors",
        "seeding",
        "json_values",
        "atomic_files",
        "progress",
        "run_folder",
        "stateful",
    },
    {"data"},
    {"submodel"},
    {"models", "client"},
    {"algorithms", "masking", "privacy"},
    {"engine", "config"},
    {"checks", "report"},
    {"experiment", "flower", "cli", "catalog"},
]


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. fedsub.engine.loop
    target: str  # the imported fedsub module, e.g. fedsub.submodel.params
    at_import_time: bool  # module level and not under TYPE_CHECKING
    line: int


def module_name(path: Path, source: Path = SOURCE) -> str:
    parts = list(path.relative_to(source.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    """``fedsub.engine.loop`` -> ``engine``; the package's own ``__init__`` is ``fedsub``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fedsub"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(
    body: list[ast.stmt], at_import_time: bool
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with whether it runs when the module is imported."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, at_import_time
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.body, False)
            yield from _import_nodes(node.orelse, at_import_time)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import | ast.ImportFrom):
                    yield inner, False
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _import_nodes([child], at_import_time)


def _targets(node: ast.Import | ast.ImportFrom, modules: set[str]) -> Iterator[str]:
    """The fedsub modules an import statement loads (``from p import m`` loads ``p.m``)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names if a.name in modules)
        return
    assert node.level == 0, "fedsub uses absolute imports only"
    base = node.module or ""
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:
            yield f"{base}.{alias.name}"
        elif base in modules:
            yield base


def read_imports(source: Path = SOURCE) -> tuple[set[str], list[Import]]:
    paths = sorted(source.rglob("*.py"))
    modules = {module_name(p, source) for p in paths}
    imports = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, at_import_time in _import_nodes(tree.body, True):
            for target in _targets(node, modules):
                source_module = module_name(path, source)
                imports.append(Import(source_module, target, at_import_time, node.lineno))
    return modules, imports


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a path whose first and last nodes are equal, or None."""
    state: dict[str, str] = {}  # "open" while on the search path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == "open":
                return [*path[path.index(successor) :], successor]
            if successor not in state:
                found = visit(successor, path)
                if found:
                    return found
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [])
            if found:
                return found
    return None


def layer_of(package: str) -> int:
    for rank, layer in enumerate(LAYERS):
        if package in layer:
            return rank
    raise AssertionError(f"package fedsub.{package} has no layer in LAYERS; add it there")


MODULES, IMPORTS = read_imports()


def test_the_source_is_read():
    # A guard against a parser that silently finds nothing: known imports must be seen.
    assert len(MODULES) > 50
    pairs = {(i.source, i.target) for i in IMPORTS}
    assert ("fedsub.engine.loop", "fedsub.engine.server_round") in pairs
    assert ("fedsub.models.base", "fedsub.submodel.params") in pairs


def test_every_package_has_a_layer():
    for module in MODULES:
        layer_of(package_of(module))


def test_packages_import_only_their_own_or_lower_layers():
    upward = [
        f"{i.source} (line {i.line}) imports {i.target}"
        for i in IMPORTS
        if layer_of(package_of(i.target)) > layer_of(package_of(i.source))
    ]
    assert not upward, "imports upwards:\n" + "\n".join(upward)


def test_the_package_graph_is_acyclic():
    graph: dict[str, set[str]] = {}
    for i in IMPORTS:
        source, target = package_of(i.source), package_of(i.target)
        if source != target:
            graph.setdefault(source, set()).add(target)
    cycle = find_cycle(graph)
    assert cycle is None, f"package import cycle: {' -> '.join(cycle or [])}"


def test_modules_imported_at_import_time_form_no_cycle():
    graph: dict[str, set[str]] = {}
    for i in IMPORTS:
        if i.at_import_time and i.source != i.target:
            graph.setdefault(i.source, set()).add(i.target)
    cycle = find_cycle(graph)
    assert cycle is None, f"module import cycle: {' -> '.join(cycle or [])}"


def test_the_checks_catch_what_they_look_for(tmp_path):
    # The same code on a planted tree: a cycle through two modules, a lazy import, and an
    # import under TYPE_CHECKING (which runs at type-checking time only).
    package = tmp_path / "fedsub"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("from fedsub.low import b\n")
    (package / "low" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import fedsub.low.a\n"
        "if TYPE_CHECKING:\n    from fedsub.high import c\n"
        "def f():\n    from fedsub import high\n"
    )
    (package / "high.py").write_text("from fedsub.low.a import x\n")
    modules, imports = read_imports(package)
    assert modules == {"fedsub", "fedsub.low", "fedsub.low.a", "fedsub.low.b", "fedsub.high"}
    found = {(i.source, i.target, i.at_import_time) for i in imports}
    assert found == {
        ("fedsub.low.a", "fedsub.low.b", True),
        ("fedsub.low.b", "fedsub.low.a", True),
        ("fedsub.low.b", "fedsub.high", False),
        ("fedsub.high", "fedsub.low.a", True),
    }
    runtime = {"fedsub.low.a": {"fedsub.low.b"}, "fedsub.low.b": {"fedsub.low.a"}}
    assert find_cycle(runtime) == ["fedsub.low.a", "fedsub.low.b", "fedsub.low.a"]
    assert find_cycle({"x": {"y"}, "y": {"z"}}) is None
