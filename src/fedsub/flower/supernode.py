"""A Flower SuperNode for fedsub deployments: Flower's own ``flower-supernode`` (same
arguments, same protocol with the SuperLink), started fast:

    python -m fedsub.flower.supernode [--idle-poll 0.1] [--cold] -- <flower-supernode arguments>

What a round costs on real processes (benchmarks/flower_rounds.py) is mostly waiting, not
work. Flower 1.41's SuperNode pulls the SuperLink for a message, and when none is there sleeps
a fixed 3 s (``flwr.supernode.start_client_internal``): every wave of messages (a plain round
is one) waited up to 3 s on every node before it was picked up. Its wait for the ClientApp's
reply polls every 0.5 s; its SuperExec looks for a task to launch every 1 s
(``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``); and the ``flwr-clientapp`` process it launches per
message spends seconds importing flwr, torch and fedsub. This command:

- sets the SuperNode's idle pull to ``--idle-poll`` seconds (default 0.1: one small request to
  the SuperLink ten times a second per idle node) and its reply wait to 0.05 s, and its first
  retry of a message's object not yet on the SuperLink to 0.05 s (Flower: 1 s, doubling)
  (flower/polls.py: each checked against the installed Flower, which otherwise keeps its own,
  with one warning line);
- sets ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` to 0.1 s unless the environment sets it;
- starts fedsub's warm ClientApp launcher (flower/warm_clientapp.py) beside the SuperNode, in
  a private temporary folder first on the SuperExec's PATH, so every message's ClientApp is
  forked with flwr, torch and fedsub already imported (``--cold``: Flower's own
  ``flwr-clientapp`` per message). The launcher exits with the SuperNode.

Only the default isolation (``subprocess``: the SuperNode starts its SuperExec) gets warm
ClientApps: with ``--isolation process`` the operator starts the SuperExec, whose PATH must then
hold the launcher's stand-in (``python -m fedsub.flower.warm_clientapp serve FOLDER``).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fedsub.flower.polls import (
    WAKE,
    NodePolls,
    quick_object_pulls,
    wakeable_task_polls,
    wide_object_transfers,
)
from fedsub.flower.warm_clientapp import COMMAND

WINDOW = 60.0  # seconds of fast polls after a node's last message (a run's next wave)
SUPEREXEC = "flower-superexec"
SUPEREXEC_STAND_IN = f"""#!{{python}}
import signal
signal.pthread_sigmask(signal.SIG_BLOCK, {{{{signal.{WAKE.name}}}}})  # before any thread
from fedsub.flower.supernode import superexec
superexec()
"""


def superexec() -> None:
    """Flower's ``flower-superexec`` whose task poll ends when its SuperNode wakes it."""
    from flwr.supercore.cli import flower_superexec
    from flwr.supercore.logger import log
    from flwr.supercore.superexec import run_superexec

    if not wakeable_task_polls(run_superexec):
        log(30, "fedsub: this Flower's SuperExec loop changed; it polls as Flower's does")
    sys.argv[0] = SUPEREXEC
    flower_superexec()


def start_launcher(folder: Path, env: dict[str, str]) -> subprocess.Popen:
    """fedsub's warm ClientApp launcher serving ``folder``, watching this process; returns
    once its ``flwr-clientapp`` stand-in is written (or the launcher failed)."""
    command = [sys.executable, "-m", "fedsub.flower.warm_clientapp", "serve", str(folder)]
    launcher = subprocess.Popen([*command, "--parent-pid", str(os.getpid())], env=env)
    deadline = time.monotonic() + 300
    while not (folder / COMMAND).exists():
        if launcher.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("fedsub: error: the warm ClientApp launcher did not start")
        time.sleep(0.05)
    return launcher


def main(argv: list[str] | None = None, run: Callable[[], object] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fedsub.flower.supernode",
        description="Flower's SuperNode with short polls and warm ClientApps; the other "
        "arguments (after --) are flower-supernode's.",
    )
    parser.add_argument(
        "--idle-poll", type=float, default=0.1, help="seconds between pulls in a run (Flower: 3)"
    )
    parser.add_argument("--cold", action="store_true", help="Flower's flwr-clientapp")
    args, rest = parser.parse_known_args(argv)
    if not 0.01 <= args.idle_poll <= 60:
        parser.error(f"--idle-poll {args.idle_poll}: expected seconds in [0.01, 60]")
    rest = rest[1:] if rest[:1] == ["--"] else rest
    from flwr.supercore.logger import log
    from flwr.supernode import start_client_internal

    if not (NodePolls(args.idle_poll, WINDOW).install(start_client_internal)):
        log(30, "fedsub: this Flower's SuperNode loop changed; it polls as Flower's does")
    if not quick_object_pulls():
        log(30, "fedsub: this Flower's object pulls changed; they back off as Flower's do")
    if not wide_object_transfers():
        log(30, "fedsub: this Flower's object transfers changed; they go as Flower's do")
    folder = Path(tempfile.mkdtemp(prefix="fedsub-node-"))  # private (0700)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    stand_in = folder / SUPEREXEC
    stand_in.write_text(SUPEREXEC_STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o700)
    if not args.cold:
        start_launcher(folder, dict(os.environ))
    os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
    if run is None:
        from flwr.supernode.cli.flower_supernode import flower_supernode

        run = flower_supernode
    sys.argv = ["flower-supernode", *rest]
    run()


if __name__ == "__main__":
    main()
