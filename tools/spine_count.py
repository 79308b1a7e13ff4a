"""Recount issue 49's spine goals in a source tree, the same way before and after:

    python tools/spine_count.py .
    git archive <commit> src | tar -x -C /tmp/before && python tools/spine_count.py /tmp/before

The spine is engine/loop.py and engine/server_round.py: their lines, the fedsub modules they
import (``ast``), the identifiers in their code (tokens: comments and docstrings aside) that
name a feature (a word ``dp``, or one starting with ``shard``, ``mask``, ``private``); then, per
feature package, the modules outside it that import it."""

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

FEATURE_PACKAGES = ("dp", "masking", "sharding", "privacy")


def fedsub_modules(path: Path) -> set[str]:
    """The fedsub modules ``path`` imports (``from fedsub import x``: ``fedsub.x``)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedsub"):
            if node.module == "fedsub":
                modules |= {f"fedsub.{a.name}" for a in node.names}
            else:
                modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules |= {a.name for a in node.names if a.name.startswith("fedsub")}
    return modules


def names_a_feature(identifier: str) -> bool:
    words = [w.lower() for w in re.split(r"_|(?<=[a-z])(?=[A-Z])", identifier) if w]
    return any(w == "dp" or w.startswith(("shard", "mask", "private")) for w in words)


def feature_names(path: Path) -> list[str]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [t.string for t in tokens if t.type == tokenize.NAME and names_a_feature(t.string)]


def main(tree: Path) -> None:
    root = tree / "src" / "fedsub"
    spine = [root / "engine" / "loop.py", root / "engine" / "server_round.py"]
    total, imported = 0, set()
    for path in spine:
        lines, modules = len(path.read_text().splitlines()), fedsub_modules(path)
        total, imported = total + lines, imported | modules
        print(
            f"{path.relative_to(root)}: {lines} lines, {len(modules)} fedsub modules imported, "
            f"{len(feature_names(path))} feature-named identifiers in code"
        )
    outside = imported - {"fedsub.engine.loop", "fedsub.engine.server_round"}
    print(f"spine: {total} lines, {len(outside)} distinct fedsub modules imported")
    for package in FEATURE_PACKAGES:
        files = []
        for path in sorted(root.rglob("*.py")):
            name = path.relative_to(root).as_posix()
            modules = fedsub_modules(path)
            inside = name.startswith(f"{package}/")
            if not inside and any(m.split(".")[1:2] == [package] for m in modules):
                files.append(name)
        print(f"{package}: imported by {len(files)} modules outside {package}/: {' '.join(files)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
