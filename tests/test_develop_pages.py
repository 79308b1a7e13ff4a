"""The developers' pages name modules by path (docs/develop/*.md, DEVELOPERS.md, the code
layout): every path they name in backticks exists, so a moved or renamed module fails here
until the pages follow it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    *sorted((ROOT / "docs" / "develop").glob("*.md")),
    ROOT / "DEVELOPERS.md",
    ROOT / "docs" / "concepts" / "layout.md",
]
FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
# `engine/loop.py`, `tests/test_backends.py: NodeLog`, `src/fedsub/plugins.py`, `configs/`
NAMED_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]*\.(?:py|toml|json|md|txt))(?::[^`]*)?`")
PLACES = [ROOT, ROOT / "src" / "fedsub", ROOT / "src"]


def named_paths(text: str) -> set[str]:
    """The file paths a page names in inline code (fenced blocks are commands, left out)."""
    return set(NAMED_PATH.findall(FENCED.sub("", text)))


def exists(path: str) -> bool:
    return any((place / path).exists() for place in PLACES)


def test_named_paths_are_read_from_inline_code_only() -> None:
    text = "See `engine/loop.py: train` and `tests/x.py`.\n```bash\npytest tests/y.py\n```\n"
    assert named_paths(text) == {"engine/loop.py", "tests/x.py"}
    assert exists("engine/loop.py") and exists("fedsub/errors.py")
    assert not exists("engine/no_such_module.py")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_developers_page_names_exists(page: Path) -> None:
    missing = sorted(p for p in named_paths(page.read_text(encoding="utf-8")) if not exists(p))
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"
