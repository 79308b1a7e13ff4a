"""Flower 1.41's fixed waits that a fedsub deployment shortens, in the process that calls
these. Each change is checked against the installed Flower (a function or literal it
replaces must be there) and, where it is not, left undone (the caller says so in one line).

- ``quick_object_pulls``: a Message travels as a tree of objects pushed one by one after the
  message itself, so a reader that pulls early (the SuperNode pulling a message from the
  SuperLink, a ClientApp from its SuperNode, the ServerApp a reply) often finds an object not
  there yet. Flower then backs off 1 s, doubling (``flwr.supercore.inflatable``'s
  ``pull_objects``): on real processes most waves paid one or more such seconds per hop. Here
  the first backoff is ``first`` (0.05 s), still doubling up to Flower's cap, with Flower's
  limits on tries and time.
- ``wide_object_transfers``: Flower pushes and pulls a message's objects (a dozen for a train
  message: each array and its chunk, each record, the message) one request each, at most
  ``min(2, cores)`` at a time (``get_num_workers``): on a 2-core host a hop costs six round
  trips one after the other, each through the other process's scheduler. Here ``workers``
  (8) requests are in flight at once, whatever the cores: the requests mostly wait on the
  other process, they use no core of their own.
- ``NodePolls``: the SuperNode's loop (``flwr.supernode.start_client_internal``) sleeps 3 s
  whenever the SuperLink has no message for it, and 0.5 s between looks for the ClientApp's
  reply. With ``NodePolls`` it pulls every ``fast`` seconds for ``window`` seconds after its
  last message (a run's next wave comes soon; polling costs the SuperLink a request each time,
  so an idle node goes back to Flower's 3 s), looks for the reply every 0.05 s, and wakes its
  SuperExec (below) as soon as a message's task is created.
- ``wakeable_task_polls``: Flower's SuperExec looks for a task to launch every
  ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` (1 s). Polling faster costs CPU on every node all the
  time (measured: 0.5 of a core for a SuperLink and 3 nodes polling every 0.1 s), so instead
  its sleep ends early when the SuperNode sends it ``WAKE`` (a signal whose default action is
  to be ignored, so a wake before the SuperExec is ready is lost, never fatal).
"""

from __future__ import annotations

import inspect
import math
import os
import signal
import subprocess
import time
import types
from collections.abc import Callable

IDLE_LITERAL, REPLY_LITERAL = 3, 0.5  # Flower 1.41's sleeps in start_client_internal
FIRST_BACKOFF = 0.05  # seconds before the first retry of an object not pushed yet
REPLY_POLL = 0.05  # seconds between two looks for the ClientApp's reply
WAKE = signal.SIGWINCH  # ignored by default: a wake that comes too early is lost, harmlessly


def quick_object_pulls(first: float = FIRST_BACKOFF) -> bool:
    """Make Flower's object pulls in this process retry after ``first`` seconds (then
    doubling) instead of 1 s; False (nothing changed) if this Flower's pulls differ."""
    from flwr.supercore.inflatable import inflatable_utils

    functions = (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree)
    defaults = [f.__kwdefaults__ or {} for f in functions]
    if not all("initial_backoff" in d for d in defaults):
        return False
    for d in defaults:
        d["initial_backoff"] = first
    return True


WORKERS = 8  # object requests in flight at once, per push or pull


def wide_object_transfers(workers: int = WORKERS) -> bool:
    """Make Flower's object pushes and pulls in this process keep ``workers`` requests in
    flight (Flower: ``min(2, cores)``); False (nothing changed) if this Flower's differ."""
    from flwr.supercore.inflatable import inflatable_utils

    functions: list[tuple[Callable[..., object], str]] = [
        (inflatable_utils.push_objects, "max_concurrent_pushes"),
        (inflatable_utils.push_object_contents_from_iterable, "max_concurrent_pushes"),
        (inflatable_utils.pull_objects, "max_concurrent_pulls"),
        (inflatable_utils.pull_and_inflate_object_from_tree, "max_concurrent_pulls"),
    ]
    if not all(key in (f.__kwdefaults__ or {}) for f, key in functions):
        return False
    if not callable(getattr(inflatable_utils, "get_num_workers", None)):
        return False
    for f, key in functions:
        f.__kwdefaults__[key] = workers  # type: ignore[index]
    inflatable_utils.get_num_workers = _as_asked
    return True


def _as_asked(max_concurrent: int) -> int:
    """Flower's ``get_num_workers`` without its ``min(..., cores)``."""
    return max(1, int(max_concurrent))


def _with_sleep(sleep: Callable[[float], None]) -> types.SimpleNamespace:
    """A stand-in for the ``time`` module: everything is ``time``'s but ``sleep``."""
    names = {n: getattr(time, n) for n in dir(time) if not n.startswith("__")}
    return types.SimpleNamespace(**{**names, "sleep": sleep})


class NodePolls:
    """The SuperNode's polls (the module docstring): fast for ``window`` seconds after the
    last message, Flower's own otherwise."""

    def __init__(self, fast: float, window: float) -> None:
        self.fast, self.window = fast, window
        self.last = -math.inf  # when the last message was stored
        self.superexec: subprocess.Popen | None = None

    def sleep(self, seconds: float) -> None:
        if seconds == REPLY_LITERAL:
            seconds = REPLY_POLL
        elif seconds == IDLE_LITERAL and time.monotonic() - self.last < self.window:
            seconds = self.fast
        time.sleep(seconds)

    def wake(self) -> None:
        """A task waits for the SuperExec: it looks for it now."""
        if self.superexec is not None and self.superexec.poll() is None:
            os.kill(self.superexec.pid, WAKE)

    def watch(self, state: object) -> None:
        """Wake the SuperExec whenever ``state`` (the SuperNode's NodeState) creates a task:
        its ClientApp then starts while the message's objects are still being pulled."""
        create = getattr(state, "create_task", None)
        if create is None or getattr(create, "wakes", False):
            return

        def create_task(*args: object, **kwargs: object) -> int | None:
            task = create(*args, **kwargs)
            if task is not None:
                self.wake()
            return task

        create_task.wakes = True  # type: ignore[attr-defined]
        state.create_task = create_task  # type: ignore[attr-defined]

    def install(self, module: types.ModuleType) -> bool:
        """Into Flower's ``start_client_internal``: its ``time``, its ``subprocess`` (to
        know the SuperExec it starts) and its ``_pull_and_store_message`` (to see a message
        pulled, and its state's tasks); False (module unchanged) if this Flower's loop
        differs."""
        source = inspect.getsource(module)
        needed = (f"time.sleep({IDLE_LITERAL})", f"time.sleep({REPLY_LITERAL})", "Popen(command)")
        if not all(s in source for s in needed) or not hasattr(module, "_pull_and_store_message"):
            return False
        pull = module._pull_and_store_message

        def pull_and_store(*args: object, **kwargs: object) -> int | None:
            self.watch(kwargs.get("state"))
            run_id = pull(*args, **kwargs)
            if run_id is not None:  # a message came: the run's next wave comes soon
                self.last = time.monotonic()
            return run_id

        def popen(*args: object, **kwargs: object) -> subprocess.Popen:
            self.superexec = subprocess.Popen(*args, **kwargs)  # type: ignore[call-overload]
            return self.superexec

        module.time = _with_sleep(self.sleep)  # type: ignore[attr-defined]
        module.subprocess = types.SimpleNamespace(Popen=popen)  # type: ignore[attr-defined]
        module._pull_and_store_message = pull_and_store  # type: ignore[attr-defined]
        return True


def wakeable_task_polls(module: types.ModuleType) -> bool:
    """Make the SuperExec's task poll in ``module`` (Flower's ``run_superexec``) end at
    ``WAKE``; False (unchanged) if this Flower's loop differs. Call it first thing in the
    process: ``WAKE`` is blocked here (threads started later inherit that) and waited for."""
    source = inspect.getsource(module)
    if "time.sleep(task_poll_interval)" not in source or source.count("time.sleep(") != 1:
        return False
    signal.pthread_sigmask(signal.SIG_BLOCK, {WAKE})

    def sleep(seconds: float) -> None:
        signal.sigtimedwait({WAKE}, seconds)

    module.time = _with_sleep(sleep)  # type: ignore[attr-defined]
    return True
