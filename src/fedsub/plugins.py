"""Extensions from installed packages: the ``fedsub.plugins`` entry-point group.

A package adds models, datasets, aggregation rules, client transforms and server optimizers
without editing fedsub by naming them in its metadata::

    [project.entry-points."fedsub.plugins"]
    bag-lr = "my_package.model:SPEC"          # a models.registry.ModelSpec
    clicks = "my_package.data:SPEC"           # a data.registry.DatasetSpec
    heat-power = "my_package.rule:HeatPower"  # an aggregation rule class
    sign = "my_package.transform:Sign"        # a client transform class

An entry point gives one object or a list of them. Each registry (a ``Registry``: the built-in
entries, then the plugins' entries of its kind) takes the objects of its kind the first time
it is read, so a config can name them and ``fedsub list`` shows them with their package.
A plugin that fails to import, gives an object of no kind, or reuses a name is skipped with a
warning naming its package and entry point (``problems`` lists them); the rest still work.

This module sits in fedsub's lowest layer: it knows no registry's types, each ``Registry``
says which objects it accepts.
"""

from __future__ import annotations

import functools
import importlib.metadata
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from fedsub.errors import ConfigError

GROUP = "fedsub.plugins"
BUILT_IN = "built-in"

T = TypeVar("T")


@dataclass(frozen=True)
class Contribution:
    """One object an entry point gives, and where it came from."""

    package: str  # the distribution's name
    entry_point: str
    value: object

    @property
    def origin(self) -> str:
        return f"plugin {self.package} (entry point {self.entry_point})"


@dataclass(frozen=True)
class Problem:
    """A plugin entry point that could not be used, and why."""

    package: str
    entry_point: str
    reason: str

    def __str__(self) -> str:
        return (
            f"fedsub plugin {self.package!r}, entry point {self.entry_point!r} "
            f"(group {GROUP}): {self.reason}"
        )


class PluginWarning(UserWarning):
    """A plugin was skipped (its package and entry point are named)."""


@functools.cache
def discover() -> tuple[tuple[Contribution, ...], tuple[Problem, ...]]:
    """Every object the installed packages' ``fedsub.plugins`` entry points give (imported
    once; ``refresh`` forgets them), and the entry points that failed to load."""
    found: list[Contribution] = []
    problems: list[Problem] = []
    for entry in importlib.metadata.entry_points(group=GROUP):
        package = entry.dist.name if entry.dist is not None else "(unknown package)"
        try:
            value = entry.load()
        except Exception as error:  # a plugin's own bug must not stop fedsub
            problem = Problem(
                package,
                entry.name,
                f"loading {entry.value!r} failed: {type(error).__name__}: {error}",
            )
            problems.append(problem)
            warnings.warn(str(problem), PluginWarning, stacklevel=2)
            continue
        values = value if isinstance(value, list | tuple) else [value]
        found += [Contribution(package, entry.name, v) for v in values]
    return tuple(found), tuple(problems)


_REGISTRIES: list[Registry[object]] = []
_MERGING = threading.local()


class Registry(Mapping[str, T], Generic[T]):
    """Named entries of one kind (models, datasets, ...): the built-in ones, then those of
    the plugins' objects that ``accepts`` takes, named by ``name_of``. A read-only mapping
    (name -> entry); built-in entries are added with ``add_built_in`` at import time."""

    def __init__(
        self,
        kind: str,
        built_in: Mapping[str, T],
        accepts: type | Callable[[object], bool],
        name_of: Callable[[T], str],
    ) -> None:
        self.kind = kind
        self._built_in: dict[str, T] = dict(built_in)
        self._accepts = accepts
        self._name_of = name_of
        self._entries: dict[str, T] | None = None
        self._origins: dict[str, str] = {}
        self._problems: list[Problem] = []
        _REGISTRIES.append(self)  # type: ignore[arg-type]  # only read as Registry[object]

    def accepts(self, value: object) -> bool:
        if isinstance(self._accepts, type):
            return isinstance(value, self._accepts)
        return self._accepts(value)

    def add_built_in(self, name: str, value: T) -> None:
        if name in self._built_in:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._built_in[name] = value
        self._entries = None

    def _merged(self) -> dict[str, T]:
        if self._entries is not None:
            return self._entries
        if getattr(_MERGING, "active", False):  # a plugin reading a registry while it loads
            return self._built_in
        _MERGING.active = True
        try:
            contributions, _ = discover()
        finally:
            _MERGING.active = False
        entries, origins, problems = dict(self._built_in), dict[str, str](), list[Problem]()
        for c in contributions:
            if not self.accepts(c.value):
                continue
            value: T = c.value  # type: ignore[assignment]  # accepts() checked its kind
            try:
                name = self._name_of(value)
            except Exception as error:
                name, reason = "", f"its {self.kind} has no name ({error})"
            else:
                reason = f"its {self.kind} has no name"
            if not name:
                problems.append(Problem(c.package, c.entry_point, reason))
            elif name in entries:
                where = origins.get(name, BUILT_IN)
                reason = f"{self.kind} {name!r} is already defined ({where}); skipped"
                problems.append(Problem(c.package, c.entry_point, reason))
            else:
                entries[name], origins[name] = value, c.origin
        for problem in problems:
            warnings.warn(str(problem), PluginWarning, stacklevel=3)
        self._entries, self._origins, self._problems = entries, origins, problems
        return entries

    def __getitem__(self, name: str) -> T:
        return self._merged()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._merged())

    def __len__(self) -> int:
        return len(self._merged())

    def names(self) -> list[str]:
        return sorted(self._merged())

    def get_or_refuse(self, name: str) -> T:
        """The entry ``name``, or ConfigError naming the choices (and plugins that failed)."""
        entries = self._merged()
        if name not in entries:
            failed = "".join(f"; {p}" for p in problems())
            raise ConfigError(
                f"unknown {self.kind} {name!r}; choose from {', '.join(sorted(entries))}{failed}"
            )
        return entries[name]

    def origin(self, name: str) -> str:
        """``"built-in"``, or the plugin package and entry point that gave ``name``."""
        self._merged()
        return self._origins.get(name, BUILT_IN)

    def problems(self) -> list[Problem]:
        self._merged()
        return list(self._problems)


def problems() -> list[Problem]:
    """Every plugin problem: entry points that failed to load, objects of no known kind (once
    every registry is imported) and names given twice."""
    contributions, failed = discover()
    found = [*failed]
    for registry in _REGISTRIES:
        found += registry.problems()
    for c in contributions:
        if not any(r.accepts(c.value) for r in _REGISTRIES):
            kinds = ", ".join(sorted({r.kind for r in _REGISTRIES}))
            found.append(
                Problem(c.package, c.entry_point, f"{c.value!r} is none of: {kinds}; skipped")
            )
    return found


def refresh() -> None:
    """Forget what was discovered (after a package was installed or put on ``sys.path``)."""
    discover.cache_clear()
    for registry in _REGISTRIES:
        registry._entries = None
