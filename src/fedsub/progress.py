"""Feedback on long work: named phases (data loading, heat counting, secure aggregation,
evaluation) and the training bar, on stderr.

Code deep in the library reports through ``phase(...)`` without being handed a reporter: the
command line installs one for the duration of a command (``reporting``); everywhere else (tests,
library use, ``--quiet``) the silent default applies, so reporting costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported only when a reporter draws (it is slow to import)
    from rich.console import Console
    from rich.progress import Progress, TaskID

Advance = Callable[[int], None]


def _ignore(steps: int) -> None:
    """Advances the silent reporter's phases: nothing to draw."""


class Reporter:
    """The silent reporter: every call is a no-op."""

    @contextmanager
    def phase(self, label: str, total: int | None = None) -> Iterator[Advance]:
        """A phase of work; ``total`` steps when known (the yielded callable advances)."""
        yield _ignore

    def training(self, plan: Sequence[tuple[str, int]]) -> None:
        """Training starts: ``plan`` lists (algorithm label, rounds) in the order they run."""

    def round(self, label: str, round_index: int) -> None:
        """Algorithm ``label`` finished round ``round_index`` (1-based)."""

    def note(self, label: str, text: str) -> None:
        """Show ``text`` after algorithm ``label``'s rounds from now on (e.g. the epsilon
        spent so far under differential privacy)."""

    @property
    def shows_notes(self) -> bool:
        """Whether ``note`` shows anything: false for the silent reporter, so a caller may
        skip computing a note nobody sees (a reporter overriding ``note`` shows them)."""
        return type(self).note is not Reporter.note


class RichReporter(Reporter):
    """Phases as transient spinners (a bar when their size is known) and one training bar
    labelled "<algorithm> (<i>/<n>) round <r>/<R>". Nothing is drawn before the first phase or
    round, so an error found while reading the config leaves stderr clean."""

    def __init__(self, console: Console | None = None) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._plan: list[tuple[str, int]] = []
        self._notes: dict[str, str] = {}

    def _display(self) -> Progress:
        if self._progress is None:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.console,
            )
            progress.start()
            self._progress = progress
        return self._progress

    @contextmanager
    def phase(self, label: str, total: int | None = None) -> Iterator[Advance]:
        display = self._display()
        task = display.add_task(label, total=total)

        def advance(steps: int) -> None:
            display.advance(task, steps)

        try:
            yield advance
        finally:
            display.remove_task(task)

    def training(self, plan: Sequence[tuple[str, int]]) -> None:
        self._plan = list(plan)
        total = sum(rounds for _, rounds in self._plan)
        self._task = self._display().add_task("training", total=total)

    def round(self, label: str, round_index: int) -> None:
        if self._task is None:
            return
        text, done = round_label(self._plan, label, round_index)
        if label in self._notes:
            text = f"{text} {self._notes[label]}"
        self._display().update(self._task, completed=done, description=text)

    def note(self, label: str, text: str) -> None:
        self._notes[label] = text

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def round_label(plan: Sequence[tuple[str, int]], label: str, round_index: int) -> tuple[str, int]:
    """The bar's label, e.g. "fedsubavg (2/3) round 14/50", and the rounds done in all."""
    names = [name for name, _ in plan]
    if label not in names:
        return f"{label} round {round_index}", 0
    position = names.index(label)
    before = sum(rounds for _, rounds in plan[:position])
    rounds = plan[position][1]
    text = f"{label} ({position + 1}/{len(plan)}) round {round_index}/{rounds}"
    return text, before + round_index


_CURRENT: ContextVar[Reporter] = ContextVar("fedsub_reporter", default=Reporter())  # noqa: B039


def current() -> Reporter:
    return _CURRENT.get()


@contextmanager
def phase(label: str, total: int | None = None) -> Iterator[Advance]:
    """Report a phase of long work to whoever listens (nobody, by default)."""
    with current().phase(label, total) as advance:
        yield advance


@contextmanager
def reporting(reporter: Reporter) -> Iterator[Reporter]:
    """Install ``reporter`` for the block (the command line's whole command)."""
    token = _CURRENT.set(reporter)
    try:
        yield reporter
    finally:
        _CURRENT.reset(token)
        close = getattr(reporter, "close", None)
        if close is not None:
            close()
