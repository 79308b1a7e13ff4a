"""``fedsub list``'s answers kept on disk, so that a repeated ``fedsub list keys`` answers
without importing torch (the registries it lists import it: seconds on a loaded machine,
where ``fedsub --help`` takes 0.1 s).

A listing is generated from the registries and the config dataclasses (cli/catalog.py), so it
changes only with fedsub's code, the Python and torch installed, or a plugin: the cache key
hashes fedsub's version, the path, size and modification time of every module of the
package (an edit in a checkout changes it), Python's and torch's versions and the kind
listed. With a plugin installed (entry points of group ``fedsub.plugins``) nothing is
cached: a plugin's code can change without anything here seeing it. The file lives in
fedsub's cache folder (files/cache_folder.py), written atomically; a cache that cannot be
read or written is simply not used.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from fedsub import __version__
from fedsub.files.cache_folder import cache_folder  # where listings are kept

PLUGIN_GROUP = "fedsub.plugins"  # plugins.GROUP (plugins.py is not imported here: it is light,
# but its registries' users are not)


def listing_key(kind: str) -> str | None:
    """The hash naming ``kind``'s listing in this installation, or None when it must not be
    cached (a plugin is installed)."""
    if importlib.metadata.entry_points(group=PLUGIN_GROUP):
        return None
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    digest = hashlib.sha256(f"{__version__}\n{sys.version}\n{torch_version}\n{kind}\n".encode())
    package = Path(__file__).resolve().parents[1]
    for module in sorted(package.rglob("*.py")):
        stat = module.stat()
        digest.update(f"{module.relative_to(package)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def cached_listing(
    kind: str, make: Callable[[], tuple[list[str], list[str]]]
) -> tuple[list[str], list[str]]:
    """``kind``'s listing and its warnings: from the cache when this installation's is there,
    else ``make()``'s (which imports the registries), then kept for the next call."""
    try:
        key = listing_key(kind)
        path = cache_folder() / f"list-{kind}-{key}.json"
    except (OSError, RuntimeError):  # RuntimeError: Path.home() without a home folder
        key, path = None, Path()
    if key is None or not path.is_absolute():  # no home folder: nowhere of the user's
        return make()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        kept = json.loads(path.read_text(encoding="utf-8"))
        return list(kept["lines"]), list(kept["warnings"])
    lines, warnings = make()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".list-")
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump({"lines": lines, "warnings": warnings}, file)
        os.replace(temporary, path)
    return lines, warnings
