"""``table``: the user's own data, one row per sample, in a CSV file (or Parquet, with pyarrow).

Columns: a client id (``client_column``), a 0/1 label (``label_column``), categorical
``features`` (one embedding row per distinct value; columns listed in ``multi_hot`` hold
several values separated by ``list_separator``), optional ``numeric`` columns (dense
features), ``crosses`` of two categorical columns (``"a*b"``: one row per pair of values).
All categorical features share one table, ``features``, with a block of rows per column.
Vocabularies are built from the training split only; a value unseen there maps to its
column's out-of-vocabulary row. The split: ``split_column`` (values ``train`` / ``test``) or
a seeded random ``test_fraction`` of the rows.

Numeric columns are standardized (``standardize``, on by default) with the training split's
mean and standard deviation per column, applied to both splits (a constant column gets std 1);
the statistics go to the run folder's ``feature_scaling.json``. Unscaled inputs such as a
price of 1-50 make a fixed learning rate diverge.

Degenerate data are refused with the file and line: fewer than 2 clients in the training
split, an empty client id, training labels all of one class, a header naming a column twice,
a label or split column also used as an input.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged
from fedsub.errors import DataError

TABLE = "features"
OOV = "<oov>"
LOG = logging.getLogger("fedsub")


@dataclass(frozen=True)
class TableOptions:
    client_column: str = "client"
    label_column: str = "label"
    features: list[str] = field(default_factory=list)
    multi_hot: list[str] = field(default_factory=list)
    list_separator: str = "|"
    numeric: list[str] = field(default_factory=list)
    crosses: list[str] = field(default_factory=list)
    test_fraction: float = field(default=0.2, metadata={"min": 0.0, "max": 0.9})
    split_column: str = ""
    standardize: bool = True


def _read_rows(path: Path) -> tuple[list[str], list[list[str]], str]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(
                f"{path}: reading Parquet needs pyarrow (pip install pyarrow)"
            ) from None
        try:
            frame = pq.read_table(path)
        except Exception as error:  # pyarrow raises many types for a bad file
            raise DataError(f"{path}: not a readable Parquet file ({error})") from None
        columns = frame.column_names
        data = [
            [("" if v is None else str(v)) for v in row]
            for row in zip(*(frame.column(c).to_pylist() for c in columns), strict=True)
        ]
        return columns, data, "row"
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            reader = csv.reader(handle)
            header = next(reader, None)
            if header is None:
                raise DataError(f"{path}: the file is empty; expected a header row")
            rows = []
            for number, row in enumerate(reader, start=2):
                if len(row) != len(header):
                    raise DataError(
                        f"{path}, line {number}: {len(row)} fields, expected {len(header)} "
                        f"(as in the header: {', '.join(header)})"
                    )
                rows.append(row)
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise DataError(f"{path}: cannot be read as UTF-8 CSV ({error})") from None
    return header, rows, "line"


def load(options: TableOptions, path: str | None, seed: int) -> FederatedDataset:
    if not path:
        raise DataError("table: set data.path to a CSV (or .parquet) file, one row per sample")
    file = Path(path)
    if not file.exists():
        raise DataError(f"table: data.path {file} does not exist")
    header, rows, unit = _read_rows(file)
    o = options
    crosses = []
    for cross in o.crosses:
        a, star, b = cross.partition("*")
        if not star or a not in o.features or b not in o.features:
            raise DataError(f"data.crosses entry {cross!r}: expected 'a*b' of two data.features")
        crosses.append((a, b))
    wanted = [o.client_column, o.label_column, *o.features, *o.numeric]
    if o.split_column:
        wanted.append(o.split_column)
    _check_header(file, header, o)
    missing = [c for c in wanted if c not in header]
    if missing:
        raise DataError(f"{file}: no column {missing[0]!r}; columns are {', '.join(header)}")
    if not rows:
        raise DataError(f"{file}: no data rows")
    col = {name: header.index(name) for name in header}
    first_line = 2 if unit == "line" else 0

    def where(i: int) -> str:
        return f"{file}, {unit} {i + first_line}"

    labels = np.empty(len(rows), dtype=np.float64)
    dense = np.empty((len(rows), len(o.numeric)), dtype=np.float64)
    for i, row in enumerate(rows):
        try:
            labels[i] = float(row[col[o.label_column]])
            dense[i] = [float(row[col[c]]) for c in o.numeric]
        except ValueError:
            raise DataError(f"{where(i)}: label and numeric columns must be numbers") from None
    largest = float(np.finfo(np.float32).max)
    fits = np.isfinite(dense) & (np.abs(dense) <= largest)
    if not np.all(fits):
        bad, column = (int(x[0]) for x in np.nonzero(~fits))
        raise DataError(
            f"{where(bad)}: numeric columns must be finite numbers of at most {largest:.3g} in "
            f"size; {o.numeric[column]} is {dense[bad, column]:g}"
        )
    if not np.all(np.isin(labels, (0.0, 1.0))):
        bad = int(np.flatnonzero(~np.isin(labels, (0.0, 1.0)))[0])
        raise DataError(f"{where(bad)}: label must be 0 or 1, got {labels[bad]:g}")

    if o.split_column:
        split = [row[col[o.split_column]] for row in rows]
        for i, value in enumerate(split):
            if value not in ("train", "test"):
                raise DataError(
                    f"{where(i)}: {o.split_column} must be train or test, got {value!r}"
                )
        is_test = np.array([v == "test" for v in split])
    else:
        is_test = np.random.default_rng([seed, 0x7AB1E]).random(len(rows)) < o.test_fraction

    def values(row: list[str], column: str) -> list[str]:
        text = row[col[column]]
        return [v for v in text.split(o.list_separator) if v] if column in o.multi_hot else [text]

    per_sample: list[list[tuple[str, str]]] = []  # (field, value) pairs of each sample
    for row in rows:
        pairs = [(c, v) for c in o.features for v in values(row, c)]
        for a, b in crosses:
            pairs += [(f"{a}*{b}", f"{x}\x1f{y}") for x in values(row, a) for y in values(row, b)]
        per_sample.append(pairs)

    fields = [*o.features, *(f"{a}*{b}" for a, b in crosses)]
    vocab: dict[str, dict[str, int]] = {f: {OOV: 0} for f in fields}
    for pairs, test in zip(per_sample, is_test, strict=True):
        if not test:
            for f, v in pairs:
                vocab[f].setdefault(v, len(vocab[f]))
    start, offset = {}, 0
    for f in fields:
        start[f], offset = offset, offset + len(vocab[f])
    ids = Ragged.from_lists(
        [[start[f] + vocab[f].get(v, 0) for f, v in pairs] for pairs in per_sample]
    )

    clients = np.array([row[col[o.client_column]] for row in rows])
    for i, client in enumerate(clients):
        if not client.strip():
            raise DataError(f"{where(i)}: empty client id in column {o.client_column!r}")
    train_rows = np.flatnonzero(~is_test)
    order = train_rows[np.argsort(clients[train_rows], kind="stable")]
    _, counts = np.unique(clients[order], return_counts=True)
    if len(order) == 0:
        raise DataError(f"{file}: every row went to the test split; nothing to train on")
    if len(counts) < 2:
        raise DataError(
            f"{file}: the training split holds {len(counts)} client "
            f"({o.client_column} = {str(clients[order[0]])!r}); federated training needs at least 2"
        )
    classes = np.unique(labels[train_rows])
    if len(classes) < 2:
        raise DataError(
            f"{file}: every training label ({o.label_column}) is {classes[0]:g}; "
            "a binary classifier needs both 0 and 1"
        )
    scaling = None
    if o.numeric and o.standardize:
        dense, scaling = standardized(dense, train_rows, o.numeric, file)
    labels = labels.astype(np.float32)
    dense_part = dense.astype(np.float32) if o.numeric else None

    def subset(index: np.ndarray) -> SampleSet:
        return SampleSet(
            {TABLE: ids.take(index)},
            labels[index],
            None if dense_part is None else dense_part[index],
        )

    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    return FederatedDataset(
        f"table:{file.name}",
        {TABLE: max(offset, 1)},
        subset(order),
        offsets,
        subset(np.flatnonzero(is_test)),
        feature_scaling=scaling,
    )


def _check_header(file: Path, header: list[str], o: TableOptions) -> None:
    """Every column name once; the label and split columns are never inputs."""
    seen: set[str] = set()
    for name in header:
        if name in seen:
            raise DataError(f"{file}, line 1: column {name!r} appears twice in the header")
        seen.add(name)
    for key, columns in (("data.features", o.features), ("data.numeric", o.numeric)):
        twice = sorted({c for c in columns if columns.count(c) > 1})
        if twice:
            raise DataError(f"{key} lists column {twice[0]!r} twice")
    inputs = {"data.client_column": [o.client_column], "data.features": o.features}
    inputs["data.numeric"] = o.numeric
    for key, column in (
        ("data.label_column", o.label_column),
        ("data.split_column", o.split_column),
    ):
        for other, columns in inputs.items():
            if column and column in columns:
                raise DataError(
                    f"{file}: column {column!r} is both {key} and in {other}; "
                    "a label or split column must not be an input"
                )
    for column in o.multi_hot:
        if column not in o.features:
            raise DataError(f"data.multi_hot lists {column!r}, which is not in data.features")


def standardized(
    dense: np.ndarray, train_rows: np.ndarray, names: list[str], file: Path
) -> tuple[np.ndarray, dict]:
    """(x - mean) / std per column, with the training split's statistics (a constant column
    gets std 1); the statistics as stored in the run's feature_scaling.json."""
    train = dense[train_rows]
    mean, std = train.mean(axis=0), train.std(axis=0)
    constant = [n for n, s in zip(names, std, strict=True) if not s > 0]
    if constant:
        LOG.warning(
            "%s: numeric column(s) %s are constant on the training split; std set to 1",
            file,
            ", ".join(constant),
        )
    std = np.where(std > 0, std, 1.0)
    scaled = (dense - mean) / std
    record = {
        "method": "standardize: (x - mean) / std, training split statistics",
        "file": str(file),
        "training_rows": len(train_rows),
        "columns": {
            n: {"mean": float(m), "std": float(s), "constant": n in constant}
            for n, m, s in zip(names, mean, std, strict=True)
        },
    }
    return scaled, record
