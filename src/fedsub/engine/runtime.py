"""The in-process engine's capabilities (``algorithms/runtimes.py``): it runs everything
fedsub's pieces need in one process (or a torchrun group)."""

from __future__ import annotations

from fedsub.algorithms.runtimes import CAPABILITIES, Runtime

IN_PROCESS = Runtime("the in-process engine", frozenset(CAPABILITIES))
