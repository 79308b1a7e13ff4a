"""The FedSubAvg papers' Amazon CTR data, in two forms.

``amazon-fedsubavg``: the authors' per-user files, a folder of ``user_<uid>`` files, one
sample per line, tab-separated: label, user id, target item id, comma-separated history item
ids (``0`` = empty history). The files are in time order and ship no test set: the last
``test_fraction`` (default 20%) of each user's lines are held out as the test set.

``amazon-electronics``: the public ratings-only CSV (user, item, rating, timestamp), processed
as the authors did: click = rating 5; users with at least ``min_ratings`` ratings; one sample
per rating with history = the user's earlier clicked items in time order (at most
``max_history``, the most recent); train = timestamp <= ``split_timestamp`` (1385000000).
Without ``data.path`` the file fetched into the cache is used (``fedsub data fetch
amazon-electronics --unpinned``: SNAP publishes no checksum).

Fields: ``user`` (table ``user``), ``item`` and ``history`` (both table ``item``). Ids are
re-numbered densely; the history is real item ids (not the authors' iterator's zeros).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.fetch import cached_file
from fedsub.data.ragged import Ragged
from fedsub.errors import DataError

FIELD_TABLES = {"user": "user", "item": "item", "history": "item"}


@dataclass(frozen=True)
class AmazonFilesOptions:
    test_fraction: float = field(default=0.2, metadata={"min": 0.0, "max": 0.9})
    """The last share of each user's lines (time order) held out as the test set (the authors ship
    none)."""


@dataclass(frozen=True)
class AmazonRatingsOptions:
    min_ratings: int = field(default=41, metadata={"min": 1})
    """Users with at least this many ratings are clients: 41, the paper's "more than 40" (seed
    001); the authors' code keeps users with 40 or more (``min_ratings = 40``)."""
    split_timestamp: int = 1385000000
    """Ratings up to this Unix time train, later ones test."""
    max_history: int = field(default=50, metadata={"min": 1})
    """At most this many earlier clicks form a sample's history."""


@dataclass
class _Builder:
    """Collects samples (user, item, history, label, is_test) and numbers the ids densely."""

    users: dict[str, int] = field(default_factory=dict)
    items: dict[str, int] = field(default_factory=dict)
    rows: list[tuple[int, int, list[int], float, bool]] = field(default_factory=list)

    def item(self, raw: str) -> int:
        return self.items.setdefault(raw, len(self.items))

    def add(self, user: str, item: str, history: list[str], label: float, test: bool) -> None:
        uid = self.users.setdefault(user, len(self.users))
        self.rows.append((uid, self.item(item), [self.item(h) for h in history], label, test))

    def dataset(self, name: str) -> FederatedDataset:
        if not self.rows:
            raise DataError(f"{name}: no samples")
        users = np.array([r[0] for r in self.rows])
        is_test = np.array([r[4] for r in self.rows])
        train = np.flatnonzero(~is_test)
        train = train[np.argsort(users[train], kind="stable")]
        if len(train) == 0:
            raise DataError(f"{name}: every sample fell in the test split")
        _, counts = np.unique(users[train], return_counts=True)

        def subset(index: np.ndarray) -> SampleSet:
            chosen = [self.rows[i] for i in index]
            return SampleSet(
                {
                    "user": Ragged.from_lists([[r[0]] for r in chosen]),
                    "item": Ragged.from_lists([[r[1]] for r in chosen]),
                    "history": Ragged.from_lists([r[2] for r in chosen]),
                },
                np.array([r[3] for r in chosen], dtype=np.float32),
            )

        offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
        return FederatedDataset(
            name,
            {"user": len(self.users), "item": max(len(self.items), 1)},
            subset(train),
            offsets,
            subset(np.flatnonzero(is_test)),
            dict(FIELD_TABLES),
        )


def load_fedsubavg_files(options: AmazonFilesOptions, path: str | None, seed: int):
    del seed  # the split is by position in each user's file
    if not path:
        raise DataError("amazon-fedsubavg: set data.path to the folder of user_<uid> files")
    folder = Path(path)
    files = sorted(folder.glob("user_*")) if folder.is_dir() else []
    if not files:
        raise DataError(f"amazon-fedsubavg: no user_<uid> files in {folder}")
    builder = _Builder()
    for file in files:
        try:
            lines = [x for x in file.read_text(encoding="utf-8").splitlines() if x.strip()]
        except (OSError, UnicodeDecodeError) as error:
            raise DataError(f"{file}: cannot be read ({error})") from None
        held_out = round(len(lines) * options.test_fraction)
        for number, line in enumerate(lines, start=1):
            parts = line.split("\t")
            if len(parts) != 4 or parts[0] not in ("0", "1") or not parts[2].strip():
                raise DataError(
                    f"{file}, line {number}: expected 4 tab-separated fields: label (0/1), "
                    f"user id, target item id, comma-separated history ids; got {line[:80]!r}"
                )
            history = [h for h in parts[3].split(",") if h and h != "0"]
            test = number > len(lines) - held_out
            builder.add(parts[1], parts[2], history, float(parts[0]), test)
    return builder.dataset("amazon-fedsubavg")


def load_ratings_csv(options: AmazonRatingsOptions, path: str | None, seed: int):
    del seed
    file = Path(path) if path else cached_file("amazon-electronics")
    if file is None:
        raise DataError(
            "amazon-electronics: no data. Run `fedsub data fetch amazon-electronics --unpinned` "
            "(no public checksum exists), or set data.path to the ratings CSV (user, item, "
            "rating, timestamp)"
        )
    records: dict[str, list[tuple[int, str, float]]] = {}
    try:
        with open(file, newline="", encoding="utf-8") as handle:
            for number, row in enumerate(csv.reader(handle), start=1):
                if len(row) != 4:
                    raise DataError(f"{file}, line {number}: expected user,item,rating,timestamp")
                try:
                    rating, stamp = float(row[2]), int(float(row[3]))
                except ValueError:
                    raise DataError(
                        f"{file}, line {number}: rating and timestamp must be numbers, got "
                        f"{row[2]!r}, {row[3]!r}"
                    ) from None
                records.setdefault(row[0], []).append((stamp, row[1], rating))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise DataError(f"{file}: cannot be read as a UTF-8 CSV ({error})") from None
    builder = _Builder()
    for user, events in records.items():
        if len(events) < options.min_ratings:
            continue
        clicked: list[str] = []
        for stamp, item, rating in sorted(events, key=lambda e: e[0]):
            label = float(rating == 5)
            history = clicked[-options.max_history :]
            builder.add(user, item, history, label, stamp > options.split_timestamp)
            if label:
                clicked.append(item)
    return builder.dataset("amazon-electronics")
