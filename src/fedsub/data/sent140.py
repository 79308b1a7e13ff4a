"""``sent140``: Sentiment140 tweets, clients = users (seed 001: users with more than 40).

Two formats in ``data.path``: the official CSV (``training.1600000.processed.noemoticon.csv``:
polarity 0/2/4, id, date, query, user, text; Latin-1; neutral tweets dropped, 4 -> 1), alone or
in the official ``trainingandtestdata.zip`` (what ``fedsub data fetch sent140`` caches and what
is used when ``data.path`` is unset), or
LEAF's JSON (``users``, ``num_samples``, ``user_data`` -> {``x``, ``y``}; an ``x`` entry is the
text or a list whose last string is the text), a file or a folder of ``*.json``.
Text is lower-cased and split into words (``[a-z0-9']+``, ``@user`` and URLs collapsed to
tokens); the vocabulary holds the ``vocab_size`` most frequent training words (id 0 is the
out-of-vocabulary word); each tweet keeps its first ``max_tokens`` words. A seeded random
``test_fraction`` of every kept user's tweets forms the test set.
"""

from __future__ import annotations

import csv
import io
import json
import re
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.fetch import cached_file
from fedsub.data.ragged import Ragged
from fedsub.errors import DataError

TOKEN = re.compile(r"https?://\S+|@\w+|[a-z0-9']+")


@dataclass(frozen=True)
class Sent140Options:
    min_samples: int = field(default=41, metadata={"min": 1})
    """Clients are users with at least this many tweets ("more than 40")."""
    vocab_size: int = field(default=10_000, metadata={"min": 1})
    """Words in the vocabulary, from the training split (id 0 = out of vocabulary)."""
    max_tokens: int = field(default=25, metadata={"min": 1})
    """Words kept per tweet."""
    test_fraction: float = field(default=0.2, metadata={"min": 0.0, "max": 0.9})
    """Each user's share of tweets held out into the pooled test set."""


def tokenize(text: str) -> list[str]:
    words = []
    for token in TOKEN.findall(text.lower()):
        if token.startswith("http"):
            words.append("<url>")
        elif token.startswith("@"):
            words.append("<user>")
        else:
            words.append(token)
    return words


TRAINING_CSV = "training.1600000.processed.noemoticon.csv"  # inside the official zip


def _parse_csv(handle: TextIO, where: str) -> list[tuple[str, str, float]]:
    samples = []
    for number, row in enumerate(csv.reader(handle), start=1):
        if len(row) != 6:
            raise DataError(
                f"{where}, line {number}: expected 6 fields (polarity, id, date, query, user, "
                f"text), got {len(row)}"
            )
        if row[0] not in ("0", "2", "4"):
            raise DataError(f"{where}, line {number}: polarity must be 0, 2 or 4, got {row[0]!r}")
        if row[0] != "2":
            samples.append((row[4], row[5], float(row[0] == "4")))
    return samples


def _read_csv(path: Path) -> list[tuple[str, str, float]]:
    """The official CSV, as a file or inside the official ``trainingandtestdata.zip``."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                if TRAINING_CSV not in archive.namelist():
                    raise DataError(f"{path}: the archive has no {TRAINING_CSV}")
                with archive.open(TRAINING_CSV) as raw:
                    text = io.TextIOWrapper(raw, encoding="latin-1", newline="")
                    return _parse_csv(text, f"{path}:{TRAINING_CSV}")
        with open(path, newline="", encoding="latin-1") as handle:
            return _parse_csv(handle, str(path))
    except (OSError, csv.Error, zipfile.BadZipFile) as error:
        raise DataError(f"{path}: cannot be read as CSV ({error})") from None


def _text(x: object) -> str | None:
    """A LEAF sample: the text itself, or a list whose last string is the text."""
    if isinstance(x, str):
        return x
    if isinstance(x, list):
        return next((v for v in reversed(x) if isinstance(v, str)), None)
    return None


def _read_leaf(files: list[Path]) -> list[tuple[str, str, float]]:
    samples = []
    for path in files:
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
            users, data = document["users"], document["user_data"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise DataError(
                f"{path}: not LEAF JSON (expected keys users, num_samples, user_data; {error})"
            ) from None
        for user in users:
            record = data.get(user) if isinstance(data, dict) else None
            if not isinstance(record, dict) or len(record.get("x", ())) != len(record.get("y", ())):
                raise DataError(f"{path}: user {user!r} needs lists x and y of equal length")
            for x, y in zip(record["x"], record["y"], strict=True):
                text = _text(x)
                if text is None or y not in (0, 1, 0.0, 1.0):
                    raise DataError(f"{path}: user {user!r} has a sample that is not (text, 0/1)")
                samples.append((str(user), text, float(y)))
    return samples


def load(options: Sent140Options, path: str | None, seed: int) -> FederatedDataset:
    samples = _read_samples(path)
    train_rows, test_rows, counts = _split_by_user(samples, options, seed)
    tokens = {i: tokenize(samples[i][1])[: options.max_tokens] for i in train_rows + test_rows}
    frequency = Counter(w for i in train_rows for w in tokens[i])
    vocab = {w: j + 1 for j, (w, _) in enumerate(frequency.most_common(options.vocab_size))}

    def subset(rows: list[int]) -> SampleSet:
        ids = Ragged.from_lists([[vocab.get(w, 0) for w in tokens[i]] for i in rows])
        labels = np.array([samples[i][2] for i in rows], dtype=np.float32)
        return SampleSet({"words": ids}, labels)

    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    return FederatedDataset(
        "sent140", {"words": len(vocab) + 1}, subset(train_rows), offsets, subset(test_rows)
    )


def _read_samples(path: str | None) -> list[tuple[str, str, float]]:
    """(user, text, label) of every tweet, from LEAF JSON or the Sentiment140 CSV (or zip)."""
    located = Path(path) if path else cached_file("sent140")
    if located is None:
        raise DataError(
            "sent140: no data. Run `fedsub data fetch sent140`, or set data.path to the "
            f"Sentiment140 zip or its {TRAINING_CSV}, or to LEAF JSON (a file or a folder)"
        )
    root = located
    if root.is_dir():
        files = sorted(root.glob("*.json"))
        if not files:
            raise DataError(f"sent140: no *.json (LEAF) files in {root}")
        return _read_leaf(files)
    if root.suffix == ".json":
        return _read_leaf([root])
    if root.exists():
        return _read_csv(root)
    raise DataError(f"sent140: data.path {root} does not exist")


def _split_by_user(
    samples: list[tuple[str, str, float]], options: Sent140Options, seed: int
) -> tuple[list[int], list[int], list[int]]:
    """Training and test rows (training rows grouped by user, users in sorted order) and each
    user's number of training rows; users with fewer than ``min_samples`` tweets are dropped,
    and each kept user keeps at least one training tweet."""
    by_user: dict[str, list[int]] = {}
    for i, (user, _, _) in enumerate(samples):
        by_user.setdefault(user, []).append(i)
    kept = sorted(u for u, rows in by_user.items() if len(rows) >= options.min_samples)
    if not kept:
        raise DataError(f"sent140: no user has at least {options.min_samples} tweets")
    rng = np.random.default_rng([seed, 0x5E47])
    train_rows: list[int] = []
    test_rows: list[int] = []
    counts: list[int] = []
    for user in kept:
        rows = np.array(by_user[user])
        test = rng.random(len(rows)) < options.test_fraction
        if test.all():
            test[0] = False
        train_rows.extend(rows[~test])
        test_rows.extend(rows[test])
        counts.append(int((~test).sum()))
    return train_rows, test_rows, counts
