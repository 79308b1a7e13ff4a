"""A warm launcher of Flower ClientApp processes: each message a SuperNode receives starts a
``flwr-clientapp`` process (Flower 1.41: one process per message, in either isolation
mode), which spends seconds importing flwr, torch and fedsub before it reads the message. This
launcher imports them once and forks a ready child per message instead.

    python -m fedsub.flower.warm_clientapp serve ~/.fedsub-warm   # once per SuperNode host
    PATH=~/.fedsub-warm:$PATH flower-supernode ...                # the SuperNode, as usual

``serve`` writes a ``flwr-clientapp`` stand-in into its folder (made private, 0700), then
listens on ``launcher.sock`` beside it. The SuperNode's SuperExec starts ``flwr-clientapp``
from its PATH: the stand-in (a Python started without ``site``, about 20 ms) sends its
arguments to the launcher, which forks a child that runs Flower's own ``flwr-clientapp`` with
them (same token, same Runtime API: Flower's protocol and checks are unchanged), and the
stand-in exits. If the launcher is not running, the stand-in runs Flower's
``flwr-clientapp`` itself, so a node never stops answering. Children are reaped by the
kernel (SIGCHLD ignored in the launcher, restored in each child); a child's output goes to the
launcher's. One launcher serves one SuperNode (or several on one host: a child only talks to
the Runtime API whose address and token the SuperNode gave it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

SOCKET = "launcher.sock"
COMMAND = "flwr-clientapp"

STAND_IN = """#!{python} -S
import os, socket, sys
launcher = socket.socket(socket.AF_UNIX)
try:
    launcher.connect({socket_path!r})
except OSError:  # no launcher: Flower's own flwr-clientapp
    os.execv({real!r}, [{real!r}, *sys.argv[1:]])
launcher.sendall(({json_dumps}(sys.argv[1:]) + "\\n").encode())
launcher.recv(16)
"""


def stand_in(folder: Path, real: str) -> Path:
    """Write the ``flwr-clientapp`` stand-in into ``folder`` (atomically: its presence says
    the launcher listens); its path."""
    text = STAND_IN.format(
        python=sys.executable,
        socket_path=str(folder / SOCKET),
        real=real,
        json_dumps="__import__('json').dumps",
    )
    path, temporary = folder / COMMAND, folder / f".{COMMAND}.tmp"
    temporary.write_text(text)
    temporary.chmod(0o755)
    os.replace(temporary, path)
    return path


def _entry(spec: str) -> Callable[[], object]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def serve(
    folder: Path,
    entry: str = "flwr.supernode.cli.flwr_clientapp:flwr_clientapp",
    parent: int | None = None,
) -> None:
    """Import what a ClientApp needs, then fork a child running ``entry`` (Flower's
    ``flwr-clientapp``) with each set of arguments the stand-in sends; ``parent``: exit
    when that process does (fedsub.flower.supernode starts the launcher so)."""
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent, folder), daemon=True).start()
    run = _entry(entry)
    from fedsub.flower.polls import quick_object_pulls, wide_object_transfers

    quick_object_pulls()  # a child pulls its message's objects as its SuperNode stores them
    wide_object_transfers()  # ... several at a time, and pushes its reply's so
    elsewhere = [p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != folder]
    real = shutil.which(COMMAND, path=os.pathsep.join(elsewhere))
    if real is None:
        raise SystemExit(f"fedsub: error: no {COMMAND} on the PATH to fall back to")
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # the socket runs ClientApps: its folder is the user's alone
    (folder / SOCKET).unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(folder / SOCKET))
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    print(f"fedsub warm ClientApp launcher: {stand_in(folder, real)}", flush=True)
    # the imports every child shares, after the stand-in is there (its SuperNode starts
    # meanwhile; a first ClientApp waits on the socket until they are done): torch, fedsub's
    # ClientApp, and fedsub.flower.apps (make_client_app: what an app's client module imports,
    # e.g. examples/flower-fedsubavg's; its server-side imports cost every child a quarter of
    # a second of CPU when not imported here)
    import torch  # noqa: F401

    import fedsub.flower.apps
    import fedsub.flower.client_app  # noqa: F401

    while True:
        connection, _ = listener.accept()
        with connection:
            arguments = _read_arguments(connection)
            if arguments is None:
                continue
            child = os.fork()
            if child == 0:  # the child: Flower's flwr-clientapp, already warm
                listener.close()
                connection.close()
                os._exit(_child(run, arguments))
            print(f"fedsub warm ClientApp launcher: ClientApp process {child}", flush=True)
            connection.sendall(b"started")


def _exit_with(parent: int, folder: Path) -> None:
    """Exit (the stand-in then falls back to Flower's flwr-clientapp) once ``parent`` is
    gone."""
    while True:
        time.sleep(0.5)
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            (folder / SOCKET).unlink(missing_ok=True)
            os._exit(0)
        except PermissionError:  # alive, another user's
            pass


def _read_arguments(connection: socket.socket) -> list[str] | None:
    received = b""
    while not received.endswith(b"\n") and len(received) < 65536:
        chunk = connection.recv(4096)
        if not chunk:
            break
        received += chunk
    try:
        arguments = json.loads(received)
    except ValueError:
        return None
    ok = isinstance(arguments, list) and all(isinstance(a, str) for a in arguments)
    return arguments if ok else None


def _child(run: Callable[[], object], arguments: list[str]) -> int:
    """Run ``run`` as ``flwr-clientapp <arguments>``; its exit code."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sys.argv = [COMMAND, *arguments]
    try:
        run()
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedsub.flower.warm_clientapp")
    commands = parser.add_subparsers(dest="command", required=True)
    serving = commands.add_parser("serve", help="fork warm flwr-clientapp processes")
    serving.add_argument("folder", type=Path, help="where the stand-in and socket go")
    serving.add_argument(
        "--entry",
        default="flwr.supernode.cli.flwr_clientapp:flwr_clientapp",
        help="what each child runs (module:function); Flower's flwr-clientapp",
    )
    serving.add_argument("--parent-pid", type=int, help="exit when this process does")
    args = parser.parse_args(argv)
    serve(args.folder.expanduser().absolute(), args.entry, args.parent_pid)


if __name__ == "__main__":
    main()
