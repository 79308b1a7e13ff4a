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

Files: CSV in UTF-8 (with or without a byte-order mark, as Excel saves it) or UTF-16 with a
byte-order mark; any other encoding is named with ``encoding`` (a Python codec name, e.g.
``"cp1252"`` for Windows-1252, ``"latin-1"``), else a byte that is not UTF-8 is refused with
its offset and line. Parquet (with pyarrow): a list column (``list<string>``, ``list<int>``, ...)
is read as the list it is, for a ``multi_hot`` column (no ``list_separator`` involved); a
boolean label is 0/1.

Degenerate data are refused with the file and line: fewer than 2 clients in the training
split, an empty client id, training labels all of one class, a header naming a column twice,
a label or split column also used as an input, a label or numeric cell that is not a number
(naming the column and the value), a list where a single value is expected, no input column
at all. With ``features = []`` the samples have no ids (dense ``numeric`` features only).
"""

from __future__ import annotations

import codecs
import csv
import io
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged
from fedsub.errors import DataError

TABLE = "features"
OOV = "<oov>"
LOG = logging.getLogger("fedsub")


def _codec(name: str) -> None:
    """``encoding`` must be "auto" or a codec Python knows."""
    if name == "auto":
        return
    try:
        codecs.lookup(name)
    except LookupError:
        raise ValueError(
            'not a known encoding; use "auto" (UTF-8, UTF-8 with a byte-order mark, UTF-16 '
            'with one) or a Python codec name such as "cp1252" or "latin-1"'
        ) from None


def _some_text(value: str) -> None:
    if not value:
        raise ValueError("it must be at least one character (multi_hot values are split on it)")


@dataclass(frozen=True)
class TableOptions:
    client_column: str = "client"
    """The client id column."""
    label_column: str = "label"
    """The 0/1 label column."""
    features: list[str] = field(default_factory=list)
    """Categorical columns: one embedding row per distinct value of the training split (unseen
    values map to the column's out-of-vocabulary row)."""
    multi_hot: list[str] = field(default_factory=list)
    """Columns holding several values joined by list_separator (or, in Parquet, a list column)."""
    list_separator: str = field(default="|", metadata={"validate": _some_text})
    """The separator of multi_hot values in a CSV."""
    numeric: list[str] = field(default_factory=list)
    """Numeric columns (dense features)."""
    crosses: list[str] = field(default_factory=list)
    """Crosses of two categorical columns, `a*b`."""
    test_fraction: float = field(default=0.2, metadata={"min": 0.0, "max": 0.9})
    """Each client's held-out share, when there is no split_column."""
    split_column: str = ""
    """A column with values train / test (instead of test_fraction)."""
    standardize: bool = True
    """Numeric columns: (x - mean) / std of the training split (written to
    `<out>/feature_scaling.json` and applied to the test split)."""
    encoding: str = field(default="auto", metadata={"validate": _codec})
    """A CSV's encoding: `auto` (UTF-8 with or without BOM, UTF-16 with BOM) or a Python codec such
    as `cp1252` or `latin-1` (a leading byte-order mark is dropped in every encoding)."""


Cell = str | list[str]  # a list only from a Parquet list column


def read_rows(path: Path, encoding: str = "auto") -> tuple[list[str], list[list[Cell]], str]:
    """The header, the rows (text cells; a Parquet list column's cells are lists) and how an
    error names a row ("line" of a CSV, "row" of a Parquet file)."""
    if path.suffix.lower() == ".parquet":
        return _parquet_rows(path)
    text = _decoded(path, path.read_bytes() if path.is_file() else b"", encoding)
    try:
        reader = csv.reader(io.StringIO(text, newline=""))
        header = next(reader, None)
        if header is None:
            raise DataError(f"{path}: the file is empty; expected a header row")
        rows: list[list[Cell]] = []
        for number, row in enumerate(reader, start=2):
            if len(row) != len(header):
                raise DataError(
                    f"{path}, line {number}: {len(row)} fields, expected {len(header)} "
                    f"(as in the header: {', '.join(header)})"
                )
            rows.append(list(row))
    except csv.Error as error:
        raise DataError(f"{path}, line {reader.line_num}: not valid CSV ({error})") from None
    return header, rows, "line"


def _decoded(path: Path, data: bytes, encoding: str) -> str:
    """The file's text: in ``encoding``, or ("auto") UTF-8 without or with a byte-order mark,
    or UTF-16 with one; otherwise an error naming the first byte that is not UTF-8."""
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    if encoding != "auto":
        try:  # a byte-order mark is not part of the first column's name, in any encoding
            return data.decode(encoding).removeprefix("\ufeff")
        except UnicodeDecodeError as error:
            what = f"in data.encoding = {encoding!r}"
            raise DataError(_not_text(path, data, error, what)) from None
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError as error:
            raise DataError(_not_text(path, data, error, "in UTF-16")) from None
    try:
        return data.decode("utf-8-sig")  # a leading byte-order mark (Excel's) is dropped
    except UnicodeDecodeError as error:
        raise DataError(
            _not_text(path, data, error, "in UTF-8")
            + '; save it as UTF-8, or name its encoding, e.g. data.encoding = "cp1252" '
            '(Windows) or "latin-1"'
        ) from None


def _not_text(path: Path, data: bytes, error: UnicodeDecodeError, what: str) -> str:
    offset = error.start
    line = data.count(b"\n", 0, offset) + 1
    return (
        f"{path}: byte {data[offset : offset + 1].hex()} at offset {offset} (line {line}) is not "
        f"text {what}"
    )


def _parquet_rows(path: Path) -> tuple[list[str], list[list[Cell]], str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        frame = pq.read_table(path)
    except Exception as error:  # pyarrow raises many types for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({error})") from None
    columns = [str(c) for c in frame.column_names]
    values = [frame.column(i).to_pylist() for i in range(len(columns))]
    rows = [
        [_cell(path, columns[c], r, v) for c, v in enumerate(row)]
        for r, row in enumerate(zip(*values, strict=True))
    ]
    return columns, rows, "row"


def _cell(path: Path, column: str, row: int, value: object) -> Cell:
    """A Parquet value as the CSV reader would give it: text (a boolean as 0/1, null as an
    empty cell), or a list of texts for a list column."""
    if isinstance(value, list):
        return [_scalar_text(path, column, row, v) for v in value if v is not None]
    return _scalar_text(path, column, row, value)


def _scalar_text(path: Path, column: str, row: int, value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, list | dict | tuple):
        raise DataError(
            f"{path}, row {row}: column {column!r} holds {value!r}; expected values or a list "
            "of values"
        )
    return str(value)


@dataclass(frozen=True)
class _Rows:
    """The file's rows (the header checked), and how errors name one of them."""

    file: Path | str  # the file read, or what else the rows came from (e.g. "DataFrame")
    header: list[str]
    rows: Sequence[Sequence[Cell]]
    unit: str  # "line" for CSV (numbered from 1, the header included), "row" for Parquet

    def column(self, name: str, key: str) -> list[str]:
        """A single-valued column's cells; a list in it (Parquet) is refused, naming ``key``
        (the config key that names the column)."""
        position = self.header.index(name)
        cells = [row[position] for row in self.rows]
        for i, cell in enumerate(cells):
            if isinstance(cell, list):
                raise DataError(
                    f"{self.where(i)}: column {name!r} ({key}) holds a list ({cell!r}); only "
                    "data.multi_hot columns may hold lists"
                )
        return cast(list[str], cells)

    def where(self, i: int) -> str:
        """Row ``i`` (0-based, data rows only) as the user finds it in the file."""
        return f"{self.file}, {self.unit} {i + (2 if self.unit == 'line' else 0)}"


def load(options: TableOptions, path: str | None, seed: int) -> FederatedDataset:
    """Read the file's rows as text, then check and encode them (``encode``)."""
    file = _existing_file(path)
    header, rows, unit = read_rows(file, options.encoding)
    return encode(header, rows, options, seed, file, unit, f"table:{file.name}")


def encode(
    header: list[str],
    rows: Sequence[Sequence[Cell]],
    options: TableOptions,
    seed: int,
    source: Path | str,
    unit: str,
    name: str,
) -> FederatedDataset:
    """Check and encode a table's rows (text cells; a list for a list column: a Parquet file's
    or a DataFrame's, data/from_python.py); the training split's clients in client-id order.
    Errors name ``source`` and the ``unit`` of a row ("line": numbered from 1, the header
    included; "row": numbered from 0)."""
    file = source
    crosses = _crosses(options)
    _check_header(file, header, options)
    _check_columns(file, header, rows, options)
    if not options.features and not options.numeric:
        raise DataError(
            f"{file}: data.features and data.numeric are both empty, so the model would read "
            "no column; list the categorical columns in data.features and/or the numeric ones "
            f"in data.numeric (columns are {', '.join(header)})"
        )
    table = _Rows(file, header, rows, unit)
    labels, dense = _labels_and_numeric(table, options)
    is_test = _test_split(table, options, seed)
    ids, table_size = _feature_ids(table, options, crosses, is_test)
    clients = _client_ids(table, options)
    train_rows = np.flatnonzero(~is_test)
    order, counts = _clients_in_order(table, options, clients, train_rows)
    _check_both_classes(file, labels[train_rows], options.label_column)
    scaling = None
    if options.numeric and options.standardize:
        dense, scaling = standardized(dense, train_rows, options.numeric, file)
    labels32 = labels.astype(np.float32)
    dense32 = dense.astype(np.float32) if options.numeric else None

    def subset(index: np.ndarray) -> SampleSet:
        return SampleSet(
            {TABLE: ids.take(index)} if options.features else {},
            labels32[index],
            None if dense32 is None else dense32[index],
        )

    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    return FederatedDataset(
        name,
        {TABLE: table_size} if options.features else {},
        subset(order),
        offsets,
        subset(np.flatnonzero(is_test)),
        feature_scaling=scaling,
    )


def _existing_file(path: str | None) -> Path:
    if not path:
        raise DataError("table: set data.path to a CSV (or .parquet) file, one row per sample")
    file = Path(path)
    if not file.exists():
        raise DataError(f"table: data.path {file} does not exist")
    return file


def _crosses(o: TableOptions) -> list[tuple[str, str]]:
    """``data.crosses`` as (a, b) pairs of categorical columns."""
    crosses = []
    for cross in o.crosses:
        a, star, b = cross.partition("*")
        if not star or a not in o.features or b not in o.features:
            raise DataError(f"data.crosses entry {cross!r}: expected 'a*b' of two data.features")
        crosses.append((a, b))
    return crosses


def _check_columns(
    file: Path | str, header: list[str], rows: Sequence[Sequence[Cell]], o: TableOptions
) -> None:
    """Every configured column is in the header, and there are rows to read; a missing one
    is named with the option that asks for it (a default included: ``client_column``
    is ``'client'`` unless given)."""
    wanted = [("data.client_column", o.client_column), ("data.label_column", o.label_column)]
    wanted += [("data.features", c) for c in o.features]
    wanted += [("data.numeric", c) for c in o.numeric]
    if o.split_column:
        wanted.append(("data.split_column", o.split_column))
    missing = [(option, c) for option, c in wanted if c not in header]
    if missing:
        option, column = missing[0]
        default = TableOptions.__dataclass_fields__[option.removeprefix("data.")].default
        holds = {"data.client_column": "names each row's client", "data.label_column":
                 "holds the 0/1 labels"}.get(option, "holds it")  # fmt: skip
        how = (
            f"{option} is {column!r} when not given: set {option} to the column that {holds}"
            if column == default
            else f"asked for by {option}; name a column the data have"
        )
        raise DataError(f"{file}: no column {column!r} ({how}); columns are {', '.join(header)}")
    if not rows:
        raise DataError(f"{file}: no data rows")


def _labels_and_numeric(table: _Rows, o: TableOptions) -> tuple[np.ndarray, np.ndarray]:
    """The 0/1 labels and the numeric columns (finite, float32-sized) as float64 arrays."""
    n = len(table.rows)
    labels = _numbers(table, o.label_column, "data.label_column")
    dense = np.empty((n, len(o.numeric)), dtype=np.float64)
    for j, name in enumerate(o.numeric):
        dense[:, j] = _numbers(table, name, "data.numeric")
    largest = float(np.finfo(np.float32).max)
    fits = np.isfinite(dense) & (np.abs(dense) <= largest)
    if not np.all(fits):
        bad, column = (int(x[0]) for x in np.nonzero(~fits))
        raise DataError(
            f"{table.where(bad)}: numeric columns must be finite numbers of at most "
            f"{largest:.3g} in size; {o.numeric[column]} is {dense[bad, column]:g}"
        )
    if not np.all(np.isin(labels, (0.0, 1.0))):
        bad = int(np.flatnonzero(~np.isin(labels, (0.0, 1.0)))[0])
        raise DataError(
            f"{table.where(bad)}: label column {o.label_column!r} must be 0 or 1, got "
            f"{table.column(o.label_column, 'data.label_column')[bad]!r}"
        )
    return labels, dense


def _numbers(table: _Rows, column: str, key: str) -> np.ndarray:
    """A label or numeric column as numbers; a cell that is not one is refused, naming the
    file, line, column and value."""
    cells = table.column(column, key)
    values = np.empty(len(cells), dtype=np.float64)
    for i, cell in enumerate(cells):
        try:
            values[i] = float(cell)
        except ValueError:
            shown = "an empty cell" if not cell.strip() else repr(cell)
            raise DataError(
                f"{table.where(i)}: column {column!r} ({key}) must hold numbers; it holds {shown}"
            ) from None
    return values


def _test_split(table: _Rows, o: TableOptions, seed: int) -> np.ndarray:
    """Which rows are test rows: ``split_column`` when set, else a seeded random fraction."""
    if not o.split_column:
        n = len(table.rows)
        return np.random.default_rng([seed, 0x7AB1E]).random(n) < o.test_fraction
    split = table.column(o.split_column, "data.split_column")
    for i, value in enumerate(split):
        if value not in ("train", "test"):
            raise DataError(
                f"{table.where(i)}: {o.split_column} must be train or test, got {value!r}"
            )
    return np.array([v == "test" for v in split])


def _feature_ids(
    table: _Rows, o: TableOptions, crosses: list[tuple[str, str]], is_test: np.ndarray
) -> tuple[Ragged, int]:
    """Each sample's row ids in the shared ``features`` table, and that table's size."""
    per_sample = _field_values(table, o, crosses)
    fields = [*o.features, *(f"{a}*{b}" for a, b in crosses)]
    training = (pairs for pairs, test in zip(per_sample, is_test, strict=True) if not test)
    vocab = _vocabularies(fields, training)
    start, offset = {}, 0
    for f in fields:
        start[f], offset = offset, offset + len(vocab[f])
    ids = Ragged.from_lists(
        [[start[f] + vocab[f].get(v, 0) for f, v in pairs] for pairs in per_sample]
    )
    return ids, max(offset, 1)


def _field_values(
    table: _Rows, o: TableOptions, crosses: list[tuple[str, str]]
) -> list[list[tuple[str, str]]]:
    """The (field, value) pairs of each sample: one per categorical value (several for a
    multi-hot column) and one per pair of values of each cross."""
    position = {name: i for i, name in enumerate(table.header)}
    for column in o.features:
        if column not in o.multi_hot:
            table.column(column, "data.features")  # a list there is refused

    def values(row: Sequence[Cell], column: str) -> list[str]:
        cell = row[position[column]]
        if isinstance(cell, list):  # a Parquet list column: its values as they are
            return [v for v in cell if v]
        return [v for v in cell.split(o.list_separator) if v] if column in o.multi_hot else [cell]

    per_sample = []
    for row in table.rows:
        pairs = [(c, v) for c in o.features for v in values(row, c)]
        for a, b in crosses:
            pairs += [(f"{a}*{b}", f"{x}\x1f{y}") for x in values(row, a) for y in values(row, b)]
        per_sample.append(pairs)
    return per_sample


def _vocabularies(
    fields: list[str], training: Iterable[list[tuple[str, str]]]
) -> dict[str, dict[str, int]]:
    """Per field, value -> index in order of first appearance in the training split; index 0
    is the field's out-of-vocabulary row."""
    vocab: dict[str, dict[str, int]] = {f: {OOV: 0} for f in fields}
    for pairs in training:
        for f, v in pairs:
            vocab[f].setdefault(v, len(vocab[f]))
    return vocab


def _client_ids(table: _Rows, o: TableOptions) -> np.ndarray:
    clients = np.array(table.column(o.client_column, "data.client_column"), dtype=str)
    for i, client in enumerate(clients):
        if not client.strip():
            raise DataError(f"{table.where(i)}: empty client id in column {o.client_column!r}")
    return clients


def _clients_in_order(
    table: _Rows, o: TableOptions, clients: np.ndarray, train_rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The training rows sorted by client id (stable), and each client's number of rows;
    refused unless at least 2 clients have training rows."""
    order = train_rows[np.argsort(clients[train_rows], kind="stable")]
    _, counts = np.unique(clients[order], return_counts=True)
    if len(order) == 0:
        raise DataError(f"{table.file}: every row went to the test split; nothing to train on")
    if len(counts) < 2:
        raise DataError(
            f"{table.file}: the training split holds {len(counts)} client "
            f"({o.client_column} = {str(clients[order[0]])!r}); federated training needs at least 2"
        )
    return order, counts


def _check_both_classes(file: Path | str, train_labels: np.ndarray, label_column: str) -> None:
    classes = np.unique(train_labels)
    if len(classes) < 2:
        raise DataError(
            f"{file}: every training label ({label_column}) is {classes[0]:g}; "
            "a binary classifier needs both 0 and 1"
        )


def _check_header(file: Path | str, header: list[str], o: TableOptions) -> None:
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
    dense: np.ndarray, train_rows: np.ndarray, names: list[str], file: Path | str
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
