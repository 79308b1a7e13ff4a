"""Errors in the caller's vocabulary: the Python API's keyword arguments, not the config
file's keys or the command line's flags.

The rules behind an error are shared (keys.py, config.py, files/run_folder.py: one path for config
files, ``--set`` and keyword arguments); only how the message names things differs. A public
function of the Python API wraps its work in ``spoken_as(terms)``: a fedsub error raised
inside comes out with each config key or flag it names replaced by what the caller wrote
(``train.lr`` -> ``lr``, ``--overwrite`` -> ``overwrite=True``), as the same error class.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

from fedsub.errors import ArgumentError, ConfigError, FedsubError

# The command line's run-folder flags, as fedsub.run / fedsub.sweep take them.
RUN_FLAGS = {
    r"\(unset it: --set ([\w.]+)=none\)": r"(remove \1 from the config)",
    r"--resume(?: \S+)?": "resume=True",
    r"--overwrite": "overwrite=True",
    r"--out(?: runs/NAME)?": "out=",
    r"--profile": "profile=True",
    r"--initial-model": "initial_model",
}


def keyword_terms(message: str, terms: Mapping[str, str]) -> str:
    """``message`` with each pattern of ``terms`` (a regular expression matching a config
    key such as ``train\\.lr``, or a flag) replaced by the caller's name for it."""
    for pattern, replacement in terms.items():
        message = re.sub(rf"(?<![\w.\-/\\]){pattern}(?![\w\-])", replacement, message)
    return message


def section_terms(section: str, keys: Iterable[str], spelling: str = "{key}") -> dict[str, str]:
    """Terms naming each of ``keys`` of ``section`` as ``spelling`` (``{key}``: the key
    itself), e.g. ``section_terms("model", ["embedding_dim"], "model_options['{key}']")``.
    Only the keys named: a file name such as ``data.csv`` in a message stays as it is."""
    names = "|".join(sorted((re.escape(k) for k in keys), key=len, reverse=True))
    return {
        rf"{re.escape(section)}\.({names})": spelling.replace("{key}", r"\1"),
        rf"\[{re.escape(section)}\] unknown key": "unknown keyword argument",
    }


@contextmanager
def spoken_as(terms: Mapping[str, str], arguments: bool = False) -> Iterator[None]:
    """Re-raise a fedsub error raised inside in the caller's ``terms``, as the same class
    (``arguments``: a ``ConfigError`` as an ``ArgumentError``: the config keys were the
    caller's keyword arguments)."""
    try:
        yield
    except FedsubError as error:
        message = str(error)
        spoken = keyword_terms(message, terms)
        kind: type[FedsubError] = type(error)
        if arguments and kind is ConfigError:
            kind = ArgumentError
        if spoken == message and kind is type(error):
            raise
        try:
            translated = kind(spoken)
        except TypeError:  # a subclass taking other arguments: leave it as raised
            raise error from None
        raise translated.with_traceback(error.__traceback__) from None
