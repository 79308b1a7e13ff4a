"""Helpers of the tests that start real processes (Flower SuperLink / SuperNodes): free local
ports, whether a port listens, waiting for a condition with a named timeout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

# fedsub's SuperNode (fedsub.flower.supernode: Flower's, with short polls and warm ClientApps),
# as ``Processes.start`` runs it from the environment's bin folder; flower-supernode's
# arguments follow
FEDSUB_SUPERNODE = ("python", "-m", "fedsub.flower.supernode", "--")


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


class Processes:
    """The processes a test starts: each logs to ``<folder>/<name>.log`` and runs in its own
    process group (so its children die with it); ``stop_all`` kills them all and prints the
    logs' tails (pytest shows them when the test fails)."""

    def __init__(self, folder: Path, env: dict[str, str], bin_dir: Path) -> None:
        self.folder, self.env, self.bin_dir = folder, env, bin_dir
        self.started: list[subprocess.Popen] = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        process = subprocess.Popen(
            [str(self.bin_dir / args[0]), *args[1:]],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.folder,
            start_new_session=True,
        )
        self.started.append(process)
        return process

    def stop_all(self) -> None:
        for process in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        logs = {p.name: p.read_text()[-2000:] for p in self.folder.glob("*.log")}
        print(json.dumps(logs, indent=1)[-6000:])


def flower_env(folder: Path, link: int, connection: str, bin_dir: Path, **extra: str) -> dict:
    """The environment of a test's ``flwr`` / SuperLink / SuperNode processes: a FLWR_HOME in
    ``folder`` whose default connection "test" reaches the SuperLink on port ``link``
    (``connection`` is its security line, e.g. ``insecure = true``), and ``bin_dir`` first on
    the PATH, as Flower starts its helpers from there. Each SuperExec (the SuperLink's and
    every SuperNode's) looks for a task to launch every 0.25 s instead of Flower's 1 s: a
    message's ClientApp (and a run's ServerApp) starts 0.4 s sooner on average, as the
    example's README recommends for deployments."""
    home = folder / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\n'
        f'address = "127.0.0.1:{link}"\n{connection}\n'
    )
    return {
        **os.environ,
        "FLWR_HOME": str(home),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.25",
        **extra,
    }


def descendants(ancestor: int, command: str) -> list[int]:
    """Process ids descending from ``ancestor`` (a process ``Processes`` started) whose command
    line contains ``command``, e.g. the ``flwr-serverapp`` a SuperLink launched for a run
    (through its SuperExec, in a session of its own)."""
    parent, cmdline = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # it exited meanwhile
            continue
        parent[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])  # after (comm)

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == ancestor:
                return True
        return False

    return [p for p, line in cmdline.items() if command.encode() in line and descends(p)]
