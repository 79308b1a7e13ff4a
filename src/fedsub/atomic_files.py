"""Temporary files and folders for atomic writes that honour the user's umask.

``tempfile.mkstemp``/``mkdtemp`` create 0600/0700 entries, and the rename that publishes them
keeps that mode, so results would be private whatever the user's umask says. These helpers
create the entry with mode 0666/0777 and let the umask take away what the user wants taken.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

# What every temporary name looks like (``_name``), as a glob pattern and exactly.
TEMP_PATTERN = ".*.[0-9]*.????????.tmp"
_TEMP_NAME = re.compile(r"\..+\.[0-9]+\.[0-9a-f]{8}\.tmp")


def _name(folder: Path, name: str) -> Path:
    return folder / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def create_temp_file(folder: Path, name: str) -> tuple[int, Path]:
    """A new, empty, uniquely named file beside ``folder/name``: (open descriptor, path)."""
    while True:
        path = _name(folder, name)
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), path
        except FileExistsError:
            continue


def create_temp_dir(folder: Path, name: str) -> Path:
    """A new, uniquely named, empty folder beside ``folder/name``."""
    while True:
        path = _name(folder, name)
        try:
            path.mkdir(mode=0o777)
            return path
        except FileExistsError:
            continue


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is one of these helpers' temporary entries (left by a killed write)."""
    return _TEMP_NAME.fullmatch(name) is not None


def write_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same folder and rename, so no reader sees half a file;
    the file's mode follows the umask, as any file the user writes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = create_temp_file(path.parent, path.name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
