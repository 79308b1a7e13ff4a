"""Where fedsub keeps what it can recompute (``fedsub list``'s answers, jax's compiled BLT
code and optimised strategies): ``$FEDSUB_CACHE``, or ``$XDG_CACHE_HOME/fedsub`` (default
``~/.cache/fedsub``). Downloaded datasets have their own folder (data/fetch.py)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_folder() -> Path:
    """The cache's root folder (not created here)."""
    if os.environ.get("FEDSUB_CACHE"):
        return Path(os.environ["FEDSUB_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedsub"
