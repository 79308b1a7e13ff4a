"""The test map (``tests/test_map.toml``) says, for every module of src/fedsub, which test files
exercise it, so whoever changes a module finds its tests (docs/develop/invariants.md).

The map is checked both ways, so nothing can go unmapped:

- every module under src/fedsub has an entry with at least one test file, and every entry
  names a module that exists (or is ``"*"``: the tests that concern every module, such as
  the import layers', this one, and the developers' pages' paths);
- every test file it names exists, and every test file (``tests/test_*.py``) is named by
  some entry;
- every fedsub module a test file imports (read with ``ast``, nothing is imported; imports
  inside functions too) lists that test file: the imports are the map's floor, and entries
  added by hand (a test that reaches a module through the CLI, a subprocess, a helper) stay.

After adding a module or a test file, ``python tests/test_test_map.py --suggest`` prints the
entries the map lacks (and those naming what no longer exists), and ``--write`` rewrites the
map with them: the imports' entries added, the stale ones dropped, the hand-added ones kept.
A new module that no test imports gets the tests that reach it written by hand.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "fedsub"
TESTS = ROOT / "tests"
MAP_FILE = TESTS / "test_map.toml"
EVERY_MODULE = "*"  # the key of the tests that concern every module (layers, this map, ...)

HEADER = """\
# Which test files exercise each module of src/fedsub (checked by tests/test_test_map.py).
# Key: the module's path under src/fedsub ("*": tests that concern every module). Value: test
# files under tests/.
# Every module has an entry, every tests/test_*.py is named somewhere, and every fedsub module
# a test file imports lists it. After adding a module or a test file:
#   python tests/test_test_map.py --suggest   (what is missing or stale)
#   python tests/test_test_map.py --write     (adds the imports' entries, drops stale ones)
# then add by hand the tests that reach a new module without importing it.
"""


def modules() -> list[str]:
    """Every module of the package, as its path under src/fedsub (``engine/loop.py``)."""
    return sorted(p.relative_to(SOURCE).as_posix() for p in SOURCE.rglob("*.py"))


def collected_test_files() -> list[str]:
    """Every file pytest collects (``test_*.py`` directly under tests/)."""
    return sorted(p.name for p in TESTS.glob("test_*.py"))


def module_of(dotted: str) -> str | None:
    """The file of ``fedsub.a.b`` (a module or a package's ``__init__.py``), if it exists."""
    parts = dotted.split(".")
    if parts[0] != "fedsub":
        return None
    base = SOURCE.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(SOURCE).as_posix()
    return None


def facade_names(package_init: str) -> dict[str, str]:
    """Names a package's ``__init__.py`` hands on, to the module that defines them (its
    imports, those under ``TYPE_CHECKING`` included: ``fedsub.train`` is ``library.py``'s)."""
    tree = ast.parse((SOURCE / package_init).read_text(encoding="utf-8"))
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            source = module_of(node.module)
            if source is not None:
                names.update({alias.name: source for alias in node.names})
    return names


def imported_modules(test_file: Path) -> set[str]:
    """The fedsub modules a test file imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(test_file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(m for alias in node.names if (m := module_of(alias.name)))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            package = module_of(node.module)
            if package is None:
                continue
            if not package.endswith("__init__.py"):
                found.add(package)
                continue
            handed_on = facade_names(package)
            for alias in node.names:  # from fedsub.pkg import submodule, or a name it hands on
                own = module_of(f"{node.module}.{alias.name}")
                if own is not None:
                    found.add(own)
                    continue
                found.add(package)
                if alias.name in handed_on:
                    found.add(handed_on[alias.name])
    return found


def evidence() -> dict[str, set[str]]:
    """Module -> the test files that import it."""
    tests_of: dict[str, set[str]] = {}
    for name in collected_test_files():
        for module in imported_modules(TESTS / name):
            tests_of.setdefault(module, set()).add(name)
    return tests_of


def read_map(path: Path = MAP_FILE) -> dict[str, list[str]]:
    with path.open("rb") as file:
        raw = tomllib.load(file)
    for module, tests in raw.items():
        if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
            raise ValueError(f"{path.name}: {module!r} must map to a list of test file names")
    return raw


def completed(
    mapped: Mapping[str, Iterable[str]],
    found: Mapping[str, Iterable[str]],
    existing_modules: Iterable[str],
    existing_tests: Iterable[str],
) -> dict[str, list[str]]:
    """The map with the imports' entries added and what no longer exists dropped: every
    module has an entry (empty when nothing maps to it yet), the ``"*"`` entry first."""
    tests_now = set(existing_tests)
    keys = sorted(existing_modules)
    if mapped.get(EVERY_MODULE):
        keys.insert(0, EVERY_MODULE)
    merged: dict[str, list[str]] = {}
    for module in keys:
        named = {*mapped.get(module, ()), *found.get(module, ())}
        merged[module] = sorted(named & tests_now)
    return merged


def render(mapped: Mapping[str, list[str]], width: int = 100) -> str:
    """The map as TOML: one key per module, its test files wrapped at ``width``."""
    lines = [HEADER]
    for module, tests in mapped.items():
        head, items = f'"{module}" = [', [f'"{t}"' for t in tests]
        one_line = head + ", ".join(items) + "]"
        if len(one_line) <= width:
            lines.append(one_line)
            continue
        lines.append(head)
        row = "   "
        for item in items:
            if len(row) + len(item) + 2 > width:
                lines.append(row)
                row = "   "
            row += f" {item},"
        lines.append(row)
        lines.append("]")
    return "\n".join(lines) + "\n"


def differences(mapped: Mapping[str, list[str]], wanted: Mapping[str, list[str]]) -> list[str]:
    """What ``--write`` would change, one line each."""
    lines = []
    for module in sorted(set(mapped) | set(wanted)):
        before, after = set(mapped.get(module, ())), set(wanted.get(module, ()))
        if module not in wanted:
            lines.append(f"- {module} (no such module)")
        elif module not in mapped or before != after:
            added, dropped = sorted(after - before), sorted(before - after)
            change = [*(f"+{t}" for t in added), *(f"-{t}" for t in dropped)]
            lines.append(f"{module}: {' '.join(change) or '(no test yet: add one by hand)'}")
    return lines


# --- the checks -----------------------------------------------------------------------------


def test_every_module_has_an_entry_with_tests() -> None:
    mapped = read_map()
    missing = [m for m in modules() if not mapped.get(m)]
    assert not missing, (
        f"modules without tests in tests/test_map.toml: {missing}; "
        "run `python tests/test_test_map.py --suggest`"
    )


def test_every_entry_names_a_module_that_exists() -> None:
    unknown = sorted(set(read_map()) - {EVERY_MODULE, *modules()})
    assert not unknown, f"tests/test_map.toml names modules src/fedsub lacks: {unknown}"


def test_every_named_test_file_exists() -> None:
    named = {t for tests in read_map().values() for t in tests}
    unknown = sorted(named - set(collected_test_files()))
    assert not unknown, f"tests/test_map.toml names test files tests/ lacks: {unknown}"


def test_every_test_file_is_mapped() -> None:
    named = {t for tests in read_map().values() for t in tests}
    unmapped = sorted(set(collected_test_files()) - named)
    assert not unmapped, (
        f"test files no module lists in tests/test_map.toml: {unmapped}; "
        "run `python tests/test_test_map.py --suggest`"
    )


def test_every_import_of_a_test_file_is_in_the_map() -> None:
    mapped = read_map()
    lacking = [
        f"{module}: {name}"
        for module, names in sorted(evidence().items())
        for name in sorted(names)
        if name not in mapped.get(module, ())
    ]
    assert not lacking, f"imports the map lacks (module: test file): {lacking}"


def test_the_completion_adds_imports_keeps_hand_entries_and_drops_stale_ones() -> None:
    mapped = {
        "a.py": ["test_hand.py"],
        "gone.py": ["test_a.py"],
        "b.py": ["test_gone.py"],
        EVERY_MODULE: ["test_layers.py"],
    }
    found = {"a.py": {"test_a.py"}, "c.py": {"test_c.py"}}
    tests = ["test_a.py", "test_c.py", "test_hand.py", "test_layers.py"]
    wanted = completed(mapped, found, ["c.py", "b.py", "a.py"], tests)
    assert wanted == {
        EVERY_MODULE: ["test_layers.py"],
        "a.py": ["test_a.py", "test_hand.py"],
        "b.py": [],
        "c.py": ["test_c.py"],
    }
    assert list(wanted) == [EVERY_MODULE, "a.py", "b.py", "c.py"]
    assert tomllib.loads(render(wanted)) == wanted


def main(argv: list[str]) -> int:
    if argv not in (["--suggest"], ["--write"]):
        print("usage: python tests/test_test_map.py --suggest | --write", file=sys.stderr)
        return 2
    mapped = read_map() if MAP_FILE.exists() else {}
    wanted = completed(mapped, evidence(), modules(), collected_test_files())
    changes = differences(mapped, wanted)
    if argv == ["--write"]:
        MAP_FILE.write_text(render(wanted), encoding="utf-8")
        print(f"wrote {MAP_FILE.relative_to(ROOT)}: {len(changes)} entries changed")
    print("\n".join(changes) or "the map is complete")
    unmapped = sorted(set(collected_test_files()) - {t for ts in wanted.values() for t in ts})
    empty = [m for m, ts in wanted.items() if not ts]
    if unmapped or empty:
        print(f"still to map by hand: modules {empty}, test files {unmapped}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
