"""fedsub's packages form layers, and nothing imports upwards: no import cycles.

Every module under src/fedsub is parsed with ``ast`` (nothing is imported). A package is
``fedsub.<name>`` (a folder, or a single module such as ``fedsub.config``). Checked:

- the package graph, from every import (module level, inside functions, under
  ``TYPE_CHECKING``), is acyclic and each import goes to the same or a lower layer of
  ``LAYERS``; a new package must be given a layer here;
- the module graph of the imports that run when a module is imported (module level, not
  under ``TYPE_CHECKING``) is acyclic, so no module ever sees a half-initialized one;
- adding the imports inside functions keeps it acyclic: a lazy import never hides a cycle.

Imports inside functions are allowed when they respect the layers: the command line defers
heavy imports (torch, the experiment) until a command needs them, so ``fedsub --help`` is fast.
Imports under ``TYPE_CHECKING`` (annotations only) may close a cycle between modules of one
package (``models.base`` names ``models.width``'s types), never between packages.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SOURCE = Path(__file__).resolve().parents[1] / "src" / "fedsub"

# Lowest first. A package may import from its own layer or any lower one, never a higher one.
LAYERS: list[set[str]] = [
    {
        "errors",
        "files",
        "numerics",
        "keys",
        "moved_keys",
        "vocabulary",
        "progress",
        "profiling",
        "stateful",
        "device",
        "distributed",
        "plugins",
        "feature_messages",  # a feature's messages, in the terms a runtime carries them
    },
    {"data"},
    {"submodel"},
    {"models", "client"},
    {"algorithms", "masking", "privacy", "dp"},
    {"sharding"},  # row-sharded tables under torchrun (the engine's loop uses it)
    {"engine", "config", "clock"},  # clock: the virtual clock (issue 51), hooked into the loop
    {"runs"},  # a config checked, set up (data, model, schedule), run and reported
    # ``fedsub`` itself (the package's __init__) is the public API's facade: it imports the
    # library's names lazily (PEP 562), so it sits on top; its import-time imports are leaves
    {
        "library",
        "api_arguments",
        "flower",
        "cli",
        "reproduce",
        "__main__",
        "fedsub",
    },
]


# When an import runs: when its module is imported, when a function is called, or only for
# the type checker (under ``if TYPE_CHECKING:``).
When = Literal["import", "call", "typing"]


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. fedsub.engine.loop
    target: str  # the imported fedsub module, e.g. fedsub.submodel.params
    when: When
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
    body: list[ast.stmt], when: When
) -> Iterator[tuple[ast.Import | ast.ImportFrom, When]]:
    """Every import statement in ``body`` with when it runs."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, when
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.body, "typing")
            yield from _import_nodes(node.orelse, when)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _import_nodes(node.body, "call" if when == "import" else when)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _import_nodes([child], when)


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
        for node, when in _import_nodes(tree.body, "import"):
            for target in _targets(node, modules):
                source_module = module_name(path, source)
                imports.append(Import(source_module, target, when, node.lineno))
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


def module_graph(imports: list[Import], when: set[When]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for i in imports:
        if i.when in when and i.source != i.target:
            graph.setdefault(i.source, set()).add(i.target)
    return graph


def test_modules_imported_at_import_time_form_no_cycle():
    cycle = find_cycle(module_graph(IMPORTS, {"import"}))
    assert cycle is None, f"module import cycle: {' -> '.join(cycle or [])}"


def test_no_import_inside_a_function_closes_a_cycle():
    cycle = find_cycle(module_graph(IMPORTS, {"import", "call"}))
    assert cycle is None, f"cycle through an import inside a function: {' -> '.join(cycle or [])}"


def plant(root: Path, files: dict[str, str]) -> tuple[set[str], list[Import]]:
    """A fedsub tree of ``files`` (relative path -> text) under ``root``, read back."""
    for relative, text in files.items():
        path = root / "fedsub" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return read_imports(root / "fedsub")


def test_imports_are_classified_by_when_they_run(tmp_path):
    modules, imports = plant(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": "from fedsub.low import b\n",
            "low/b.py": "from typing import TYPE_CHECKING\n"
            "import fedsub.low.a\n"
            "if TYPE_CHECKING:\n    from fedsub.high import c\n"
            "def f():\n    if True:\n        from fedsub import high\n",
            "high.py": "from fedsub.low.a import x\n",
        },
    )
    assert modules == {"fedsub", "fedsub.low", "fedsub.low.a", "fedsub.low.b", "fedsub.high"}
    assert {(i.source, i.target, i.when) for i in imports} == {
        ("fedsub.low.a", "fedsub.low.b", "import"),
        ("fedsub.low.b", "fedsub.low.a", "import"),
        ("fedsub.low.b", "fedsub.high", "typing"),
        ("fedsub.low.b", "fedsub.high", "call"),
        ("fedsub.high", "fedsub.low.a", "import"),
    }
    cycle = find_cycle(module_graph(imports, {"import"}))
    assert cycle == ["fedsub.low.a", "fedsub.low.b", "fedsub.low.a"]


def test_a_cycle_closed_by_a_lazy_import_is_found(tmp_path):
    _, imports = plant(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "import fedsub.b\n",
            "b.py": "def f():\n    import fedsub.a\n",
        },
    )
    assert find_cycle(module_graph(imports, {"import"})) is None
    cycle = find_cycle(module_graph(imports, {"import", "call"}))
    assert cycle == ["fedsub.a", "fedsub.b", "fedsub.a"]
    assert find_cycle({"x": {"y"}, "y": {"z"}}) is None
