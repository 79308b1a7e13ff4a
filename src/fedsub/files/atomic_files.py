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

from fedsub.errors import FedsubError

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


def save_figure_atomic(fig, path: Path) -> None:
    """A matplotlib figure written via a temp file and rename (its format from the suffix);
    the figure is closed."""
    import matplotlib.pyplot as plt

    fd, tmp = create_temp_file(path.parent, path.name)
    try:
        with os.fdopen(fd, "wb") as handle:
            fig.savefig(handle, dpi=110, format=path.suffix.lstrip(".").lower() or "png")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)


def image_formats() -> dict[str, str]:
    """The file suffixes (without the dot) matplotlib writes, and what each is."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    return dict(FigureCanvasBase.get_supported_filetypes())


def check_image_path(text: str, flag: str) -> Path:
    """A figure's output path, checked before any work: a suffix matplotlib writes, an
    existing folder to write it in, no folder in the way. Errors say what to do."""
    if not text.strip():
        raise FedsubError(f"{flag} is empty; give an image file, e.g. {flag} heat.png")
    path = Path(text).expanduser()
    if path.is_dir():
        raise FedsubError(f"{flag} {text} is a folder; give an image file, e.g. {flag} heat.png")
    formats = image_formats()
    suffix = path.suffix.lstrip(".").lower()
    if suffix not in formats:
        what = f"its suffix .{suffix} is not an image format" if suffix else "it has no suffix"
        raise FedsubError(
            f"{flag} {text}: {what}; end the name with one of "
            f"{', '.join('.' + f for f in sorted(formats))}"
        )
    if not path.parent.is_dir():
        raise FedsubError(
            f"{flag} {text}: the folder {path.parent} does not exist; create it first or "
            "choose another path"
        )
    try:  # the folder takes a file (permissions, a read-only filesystem): known before work
        fd, probe = create_temp_file(path.parent, path.name)
        os.close(fd)
        probe.unlink()
    except OSError as error:
        raise FedsubError(f"{flag} {text}: cannot write in {path.parent}: {error}") from None
    return path
