"""Config keys that moved out of ``[train]``: the one table of old key -> new place, and its
use wherever keys come from.

``[train]`` once held 38 keys of four concerns; the schedule stays there, and the execution,
privacy and masking keys have sections of their own. Every older config file, run folder,
``--set train.X=...`` and ``fedsub.train(X=...)`` keeps working: the config loader
(``in_sections``), ``--set`` (``moved_override``) and the Python API's keyword arguments
(``keyword_place``) all read ``MOVED``, and the docs' config reference lists it. An old key
loads with a one-line note naming its new place, printed once per run (``notes_once``); an
old and a new key for the same setting, given together in one source (a file, a dict, the
``--set`` list, keyword arguments), are refused naming both; a later source (``--set`` after the
file) overrides an earlier one whatever name either used. ``text_before_move`` writes a config
as fedsub wrote it before the move (what a Flower run's checkpoints are stamped with, so older
ones resume).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

from fedsub.errors import ConfigError

LOG = logging.getLogger("fedsub")

OLD_SECTION = "train"

# keys of the new sections that never were in [train] -> their default, as to_toml writes it
# (privacy.randomness: runs written before it drew their requests from train.seed; resumed,
# their checkpoints lack the secret and continue seeded, privacy/private_rounds.request_stages)
ADDED_SINCE: dict[tuple[str, str], str] = {
    ("execution", "table_sharding"): '"none"',
    ("privacy", "randomness"): '"secret"',
}

# old [train] key -> (its section now, its key there)
MOVED: dict[str, tuple[str, str]] = {
    "dtype": ("execution", "dtype"),
    "backend": ("execution", "backend"),
    "device": ("execution", "device"),
    "deterministic": ("execution", "deterministic"),
    "table_placement": ("execution", "table_placement"),
    "compile": ("execution", "compile"),
    "threads": ("execution", "threads"),
    "privacy": ("privacy", "level"),
    "download": ("privacy", "download"),
    "download_epsilon": ("privacy", "download_epsilon"),
    "download_keep": ("privacy", "download_keep"),
    "download_bucket": ("privacy", "download_bucket"),
    "secagg_clip": ("privacy", "secagg_clip"),
    "heat_source": ("privacy", "heat_source"),
    "rr_epsilon": ("privacy", "rr_epsilon"),
    "sketch_eps": ("privacy", "sketch_eps"),
    "sketch_delta": ("privacy", "sketch_delta"),
    "secagg_group": ("privacy", "secagg_group"),
    "masking": ("masking", "scheme"),
    "capacities": ("masking", "capacities"),
    "capacity_proportions": ("masking", "capacity_proportions"),
    "capacity_assignment": ("masking", "capacity_assignment"),
    "mask_average": ("masking", "average"),
}

Note = Callable[[str], None] | None  # how an old key is reported (None: silently)

# the notes printed so far in the run around (notes_once); None: outside any, print each
_PRINTED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "fedsub_moved_notes", default=None
)


@contextlib.contextmanager
def notes_once() -> Iterator[None]:
    """Within it (a command, a call of the Python API), each old-key note is printed once,
    however often the config is read again (the CLI reads it before and in the run)."""
    if _PRINTED.get() is not None:
        yield
        return
    token = _PRINTED.set(set())
    try:
        yield
    finally:
        _PRINTED.reset(token)


def note(text: str) -> None:
    """Print an old-key note (as a warning of the ``fedsub`` logger), once per ``notes_once``:
    a note naming only old keys noted already (wherever they were read) is left out."""
    printed = _PRINTED.get()
    if printed is not None:
        keys = set(re.findall(rf"{OLD_SECTION}\.(\w+) is now ", text)) or {text}
        if keys <= printed:
            return
        printed.update(keys)
    LOG.warning(text)


def same_setting(old: str, where: str = "") -> ConfigError:
    """The refusal of ``train.<old>`` given together with its new name."""
    section, key = MOVED[old]
    at = f"{where}: " if where else ""
    return ConfigError(
        f"{at}{OLD_SECTION}.{old} and {section}.{key} are the same setting "
        f"({OLD_SECTION}.{old} is its old name); give only {section}.{key}"
    )


def new_name(old: str) -> str:
    """``train.dtype`` -> ``execution.dtype``."""
    section, key = MOVED[old]
    return f"{section}.{key}"


def current_name(dotted: str) -> str:
    """A ``section.key``'s current name: ``train.masking`` -> ``masking.scheme``, any other
    key unchanged."""
    section, _, key = dotted.partition(".")
    return new_name(key) if section == OLD_SECTION and key in MOVED else dotted


def note_moved(old: list[str], where: str = "") -> str:
    """The one-line note old keys load with, naming each one's new place."""
    at = f"{where}: " if where else ""
    places = ", ".join(f"{OLD_SECTION}.{k} is now {new_name(k)}" for k in old)
    return f"{at}{places} (the old {'key still works' if len(old) == 1 else 'keys still work'})"


def in_sections(raw: dict[str, Any], note: Note = note, where: str = "") -> dict[str, Any]:
    """``raw`` (TOML tables) with each old ``[train]`` key moved to its new place, noted in
    one line; ``raw`` itself is not changed. Raises ``ConfigError`` naming both keys when the
    old key and its new place are both given."""
    train = raw.get(OLD_SECTION)
    if not isinstance(train, dict) or not set(train) & set(MOVED):
        return raw
    moved = {name: dict(t) if isinstance(t, dict) else t for name, t in raw.items()}
    old_table, olds = moved[OLD_SECTION], [k for k in train if k in MOVED]
    for old in olds:
        section, key = MOVED[old]
        table = moved.setdefault(section, {})
        if not isinstance(table, dict):
            return raw  # config.py refuses a section that is not a table
        if key in table:
            raise same_setting(old, where)
        table[key] = old_table.pop(old)
    if note is not None:
        note(note_moved(olds, where))
    return moved


def moved_override(section: str, key: str, note: Note = note) -> tuple[str, str]:
    """A ``--set section.key`` with an old ``train`` key read as its new place (noted)."""
    if section != OLD_SECTION or key not in MOVED:
        return section, key
    if note is not None:
        note(note_moved([key], "--set"))
    return MOVED[key]


def keyword_place(keyword: str) -> tuple[str, str] | None:
    """Where a keyword argument of ``fedsub.train`` / ``compare`` named after an old
    ``[train]`` key goes (``dtype`` -> ``execution.dtype``), or None. The keyword arguments
    keep these names: they are not deprecated, and carry no note."""
    return MOVED.get(keyword)


# [train]'s keys in the order fedsub wrote them before the move (config.to_toml)
TRAIN_BEFORE = (
    "algorithms", "rounds", "clients_per_round", "local_steps", "batch_size", "lr", "seed",
    "sampling", "heat", "dtype", "backend", "device", "deterministic", "table_placement",
    "compile", "lr_schedule", "lr_decay", "weight_decay", "clip_norm", "checkpoint_every",
    "heat_source", "rr_epsilon", "sketch_eps", "sketch_delta", "secagg_group",
    "max_update_norm", "momentum", "threads", "masking", "capacities", "capacity_proportions",
    "capacity_assignment", "mask_average", "privacy", "download", "download_epsilon",
    "download_keep", "download_bucket", "secagg_clip",
)  # fmt: skip


def text_before_move(text: str) -> str:
    """A resolved config's TOML (``config.to_toml``: one block per section, blank lines
    between) as fedsub wrote it before the keys moved: each moved key back in ``[train]``, by
    its old name and at its old place. A Flower run stamps its checkpoints with the hash of
    this text, so checkpoints written before the move still resume. A key of the new sections
    that never was in ``[train]`` stays in its section, except at the value that keeps the old
    behaviour (``ADDED_SINCE``): a run written before the key existed never had another."""
    old_name = {place: old for old, place in MOVED.items()}
    blocks: list[list[str]] = []
    moved: dict[str, str] = {}  # old name -> its line
    for block in text.split("\n\n"):
        header, *lines = block.split("\n")
        section, kept = header.strip("[]"), [header]
        for line in lines:
            key, _, value = line.partition(" = ")
            if ADDED_SINCE.get((section, key)) == value:
                continue
            if (section, key) in old_name:
                moved[old_name[(section, key)]] = f"{old_name[(section, key)]} = {value}"
            else:
                kept.append(line)
        if section not in {s for s, _ in MOVED.values()} or len(kept) > 1:
            blocks.append(kept)
    for kept in blocks:
        if kept[0] == f"[{OLD_SECTION}]":
            by_key = {line.partition(" = ")[0]: line for line in kept[1:]} | moved
            order = [k for k in TRAIN_BEFORE if k in by_key]
            kept[1:] = [by_key[k] for k in order + [k for k in by_key if k not in order]]
    return "\n\n".join("\n".join(kept) for kept in blocks)


def reference_rows() -> list[str]:
    """The table as markdown rows (the docs' config reference)."""
    rows = ["| old key | new place |", "|---|---|"]
    rows += [f"| `{OLD_SECTION}.{old}` | `{new_name(old)}` |" for old in MOVED]
    return rows
