"""One writer per output folder: an exclusive ``flock`` on ``<folder>/.fedsub.lock``.

The kernel releases the lock when its process ends, however it ends (exit, Ctrl-C, SIGKILL,
a crash), so there is never a stale lock to remove by hand. The file holds who holds it (pid,
host, command, start time) so a second writer's error can name the holder. A lock released
normally removes its file; a file left by a killed process is taken over by the next writer.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from fedsub.errors import FedsubError

LOCK_FILE = ".fedsub.lock"


def holder_record() -> dict[str, object]:
    """This process as a lock file describes it."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": shlex.join(["fedsub", *sys.argv[1:]]) if sys.argv else "fedsub",
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def _describe_holder(path: Path) -> str:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return (
            f"pid {record['pid']} on host {record['host']}, started {record['started']}: "
            f"{record['command']}"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet written its name"


@dataclass
class FolderLock:
    """A held lock; ``release`` (or the process's end) lets the next writer in."""

    path: Path
    fd: int

    @classmethod
    def acquire(cls, folder: Path, what: str = "output folder") -> FolderLock:
        """Lock ``folder`` (which must exist) or raise ``FedsubError`` naming the holder."""
        path = folder / LOCK_FILE
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as error:
                raise FedsubError(f"{what} {folder} is not writable: {error}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise FedsubError(
                    f"{what} {folder} is in use by another fedsub run ({_describe_holder(path)}); "
                    "wait for it to end, stop it, or choose another folder"
                ) from None
            except OSError as error:  # a filesystem without locks
                os.close(fd)
                raise FedsubError(f"{what} {folder}: cannot lock {path}: {error}") from None
            if _same_file(fd, path):
                break
            os.close(fd)  # its holder removed the file as we opened it: lock the new one
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(holder_record()) + "\n").encode("utf-8"))
        return cls(path, fd)

    def release(self) -> None:
        """Remove the lock file, then let go (a writer that opened the old file retries)."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):  # a folder made read-only: the lock still ends
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = -1


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def is_locked(folder: Path) -> bool:
    """Whether a live process holds ``folder``'s lock (for tests and messages)."""
    path = folder / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
