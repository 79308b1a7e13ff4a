"""Federated datasets from Python objects: per-client arrays, a pandas DataFrame, or a Flower
Datasets (``flwr-datasets``) partitioner.

- ``samples`` + ``from_clients``: each client's ids per field (one id per sample, a fixed
  number, or ragged lists), labels and dense features, and a test split; every field reads
  the table of its name unless ``field_tables`` says otherwise, and a table has as many rows
  as its largest id + 1 unless ``table_rows`` says more (sized from the ids only up to
  ``AUTO_ROWS`` rows or ``SPARSE_FACTOR`` rows per id it holds: beyond, give ``table_rows``).
- ``from_dataframe``: one row per sample, encoded by the ``table`` loader's rules
  (data/table.py: a client column, a 0/1 label, categorical ``features`` in one shared table,
  ``multi_hot``, ``numeric``, ``crosses``, the split); a cell holding a list is a multi-hot
  value list. Needs pandas (the ``pandas`` extra), imported only here.
- ``from_partitioner``: each partition of a ``flwr_datasets`` partitioner is one client, its
  rows encoded as ``from_dataframe``'s (the ``datasets`` extra).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged
from fedsub.data.table import Cell, TableOptions, encode
from fedsub.errors import ArgumentError, DataError
from fedsub.keys import parse_section
from fedsub.vocabulary import section_terms, spoken_as

# The column from_partitioner adds: which partition (client) a row came from (Flower's name).
PARTITION_COLUMN = "partition_id"
_SPLIT_COLUMN = "__fedsub_split__"
# Without table_rows, a table has as many rows as its largest id + 1, up to this many rows or
# SPARSE_FACTOR per id it holds: a stray huge id is refused, not a table of 10^12 rows.
AUTO_ROWS = 1 << 20
SPARSE_FACTOR = 64


def samples(
    labels: Any,
    ids: Mapping[str, Any] | None = None,
    dense: Any = None,
    where: str = "samples",
) -> SampleSet:
    """Samples from arrays: ``labels`` [n]; ``ids[field]`` a 1-d integer array (one id per
    sample), a 2-d one [n, L] (L ids each), a list of n id lists (ragged) or a ``Ragged``;
    ``dense`` [n, d] numbers or None. ``where`` names them in errors (e.g. "client 3").

    >>> import fedsub
    >>> part = fedsub.samples([1, 0, 1], ids={"item": [4, 7, 4], "tags": [[1, 2], [], [3]]})
    >>> len(part), sorted(part.ids)
    (3, ['item', 'tags'])
    """
    if not isinstance(where, str):
        raise ArgumentError(
            f"samples(): where must be a string (how errors name these samples), got {where!r}"
        )
    if ids is not None and not isinstance(ids, Mapping):
        raise ArgumentError(
            f"{where}: ids must be a dict from field name to that field's ids "
            f"(ids={{'item': [...]}}), got {_shape(ids)}"
        )
    for field in ids or {}:
        if not isinstance(field, str) or not field:
            raise ArgumentError(f"{where}: ids's keys must be field names (strings), got {field!r}")
    label_array = _array(labels, f"{where}: labels")
    if label_array.dtype == np.bool_:
        label_array = label_array.astype(np.float32)  # True / False: 1 / 0, as a table's cells
    if label_array.ndim != 1 or not np.issubdtype(label_array.dtype, np.number):
        raise DataError(f"{where}: labels must be a 1-d array of numbers, got {_shape(labels)}")
    if not np.isfinite(label_array).all():
        raise DataError(f"{where}: labels must be finite numbers")
    n = len(label_array)
    fields = {f: _ragged(f"{where}, field {f!r}", value, n) for f, value in (ids or {}).items()}
    dense_array = None
    if dense is not None:
        dense_array = _array(dense, f"{where}: dense")
        if dense_array.ndim != 2 or len(dense_array) != n:
            raise DataError(f"{where}: dense must be [{n}, d] numbers, got {_shape(dense)}")
        if not np.issubdtype(dense_array.dtype, np.number) or not np.isfinite(dense_array).all():
            raise DataError(f"{where}: dense features must be finite numbers")
        dense_array = dense_array.astype(np.float32)
    return SampleSet(fields, label_array.astype(np.float32), dense_array)


def from_clients(
    clients: Sequence[SampleSet],
    test: SampleSet | None = None,
    *,
    table_rows: Mapping[str, int] | None = None,
    field_tables: Mapping[str, str] | None = None,
    name: str = "arrays",
) -> FederatedDataset:
    """A federated dataset of ``clients`` (each a ``SampleSet``, e.g. from ``samples``) and a
    pooled ``test`` set (none: an empty one).

    >>> import fedsub
    >>> clients = [fedsub.samples([1, 0], ids={"item": [k, k + 1]}) for k in range(3)]
    >>> data = fedsub.from_clients(clients, table_rows={"item": 10})
    >>> data.num_clients, data.table_rows
    (3, {'item': 10})
    """
    if not isinstance(name, str):
        raise ArgumentError(f"from_clients(): name must be a string, got {name!r}")
    clients = _sample_sets(name, clients)
    if len(clients) < 2:
        raise DataError(f"{name}: {len(clients)} client(s); federated training needs at least 2")
    first = clients[0]
    for k, client in enumerate(clients):
        if len(client) == 0:
            raise DataError(f"{name}: client {k} has no samples")
        if set(client.ids) != set(first.ids):
            raise DataError(
                f"{name}: client {k} has fields {sorted(client.ids)}, client 0 has "
                f"{sorted(first.ids)}; every client needs the same fields"
            )
        if client.dense_dim != first.dense_dim:
            raise DataError(
                f"{name}: client {k} has {client.dense_dim} dense features, client 0 has "
                f"{first.dense_dim}"
            )
    if test is None:
        test = _empty_like(first)
    _check_test(name, test, first)
    _check_labels(name, clients)
    tables = _field_tables(name, field_tables, first)
    rows = _table_rows(name, [*clients, test], tables, _given_rows(name, table_rows))
    return FederatedDataset.from_clients(name, rows, list(clients), test, tables)


def from_dataframe(
    frame: Any, *, name: str = "DataFrame", seed: int = 0, **options: Any
) -> FederatedDataset:
    """The table loader's dataset from a pandas DataFrame (one row per sample); ``options``
    are the ``table`` dataset's keys (``client_column``, ``label_column``, ``features``,
    ``multi_hot``, ``numeric``, ``crosses``, ``test_fraction``, ``split_column``,
    ``standardize``). Errors name ``name`` and the row's position (from 0).

    Example (needs pandas: ``pip install 'fedsub[pandas]'``):

    ```python
    import pandas as pd
    import fedsub

    frame = pd.DataFrame(
        {"user": ["a", "a", "b", "b"], "item": ["x", "y", "x", "z"], "label": [1, 0, 0, 1]}
    )
    data = fedsub.from_dataframe(frame, client_column="user", features=["item"])
    ```
    """
    if not (hasattr(frame, "columns") and hasattr(frame, "itertuples")):
        raise ArgumentError(
            f"{name}: frame must be a pandas DataFrame (one row per sample), got "
            f"{type(frame).__name__}; a dict of columns becomes one with pandas.DataFrame(...)"
        )
    if not isinstance(name, str):
        raise ArgumentError(f"from_dataframe(): name must be a string, got {name!r}")
    seed = _seed(seed)
    header = [str(c) for c in frame.columns]
    table_options = _table_options(options)
    separator = table_options.list_separator
    rows = [
        [_cell(value, separator) for value in row]
        for row in frame.itertuples(index=False, name=None)
    ]
    with spoken_as(section_terms("data", TableOptions.__dataclass_fields__)):
        return encode(header, rows, table_options, seed, name, "row", name)


class Partitions(Protocol):
    """What fedsub reads of a ``flwr_datasets`` partitioner."""

    @property
    def num_partitions(self) -> int: ...

    def load_partition(self, partition_id: int) -> Any: ...


def from_partitioner(
    partitioner: Partitions,
    *,
    test: Any = None,
    name: str = "partitions",
    seed: int = 0,
    **options: Any,
) -> FederatedDataset:
    """Each partition of ``partitioner`` (a ``flwr_datasets.partitioner.Partitioner`` with
    its dataset assigned) is one client; its rows are encoded by the table loader's rules
    (``options``: ``from_dataframe``'s, without ``client_column``). ``test``: a held-out
    ``datasets.Dataset`` (or DataFrame) as the test split; without it, the table options'
    ``test_fraction`` or ``split_column`` choose test rows.

    Example (needs flwr-datasets: ``pip install 'fedsub[datasets]'``):

    ```python
    from datasets import Dataset
    from flwr_datasets.partitioner import IidPartitioner
    import fedsub

    partitioner = IidPartitioner(num_partitions=4)
    partitioner.dataset = Dataset.from_dict({"item": list("abcdefgh"), "label": [0, 1] * 4})
    data = fedsub.from_partitioner(partitioner, features=["item"])
    ```
    """
    if not isinstance(name, str):
        raise ArgumentError(f"from_partitioner(): name must be a string, got {name!r}")
    count = _partition_count(partitioner, name, options)
    frames = _partition_frames(partitioner, count, name)
    if test is not None:
        if options.get("split_column"):
            raise DataError(f"{name}: give either test= or split_column, not both")
        frames = [f.assign(**{_SPLIT_COLUMN: "train"}) for f in frames]
        held_out = _frame_of(test, f"{name} test").assign(
            **{PARTITION_COLUMN: "test", _SPLIT_COLUMN: "test"}
        )
        frames.append(held_out)
        options = {**options, "split_column": _SPLIT_COLUMN}
    _check_same_columns(name, frames, test is not None)
    import pandas as pd

    merged = pd.concat(frames, ignore_index=True)
    return from_dataframe(merged, name=name, seed=seed, client_column=PARTITION_COLUMN, **options)


def _partition_count(partitioner: Partitions, name: str, options: dict[str, Any]) -> int:
    """The partitioner's number of partitions (clients), refused unless it is a loaded
    flwr_datasets partitioner of at least 2, and the options name no client column."""
    count = getattr(partitioner, "num_partitions", None)
    if (
        not callable(getattr(partitioner, "load_partition", None))
        or not isinstance(count, int)
        or isinstance(count, bool)
        or count < 0
    ):
        raise ArgumentError(
            f"{name}: partitioner must be a flwr_datasets partitioner (num_partitions, "
            f"load_partition) with its dataset assigned, got {_shape(partitioner)}"
        )
    if count < 2:
        raise DataError(
            f"{name}: the partitioner has {count} partition(s); federated training needs at "
            "least 2 clients"
        )
    if "client_column" in options:
        raise DataError(
            f"{name}: client_column is not an option here; each partition is a client "
            f"(its rows get the column {PARTITION_COLUMN!r})"
        )
    return count


def _partition_frames(partitioner: Partitions, count: int, name: str) -> list[Any]:
    """Each partition as a DataFrame with its client id (zero-padded, so clients keep the
    partitions' order) in ``PARTITION_COLUMN``."""
    width = len(str(max(count - 1, 0)))
    frames = []
    for partition in range(count):
        where = f"{name} partition {partition}"
        try:
            loaded = partitioner.load_partition(partition)
        except Exception as error:  # the partitioner's own failure (e.g. no dataset assigned)
            raise DataError(
                f"{where}: the partitioner failed to load it ({type(error).__name__}: {error}); "
                "is its dataset assigned (partitioner.dataset = ...)?"
            ) from error
        frame = _frame_of(loaded, where)
        if PARTITION_COLUMN in frame.columns:
            raise DataError(f"{where}: it already has a column {PARTITION_COLUMN!r}")
        frames.append(frame.assign(**{PARTITION_COLUMN: f"{partition:0{width}d}"}))
    return frames


def _check_same_columns(name: str, frames: list[Any], with_test: bool) -> None:
    """Every partition, and the test frame (last, ``with_test``), has the first partition's
    columns: a missing one is named, not left to read as empty cells once they are merged."""
    ours = (PARTITION_COLUMN, _SPLIT_COLUMN)
    first = [str(c) for c in frames[0].columns if c not in ours]
    for index, frame in enumerate(frames[1:], start=1):
        has = [str(c) for c in frame.columns if c not in ours]
        missing = [c for c in first if c not in has]
        if missing:
            which = "test" if with_test and index == len(frames) - 1 else f"partition {index}"
            raise DataError(
                f"{name} {which}: no column(s) {', '.join(map(repr, missing))}, which partition "
                f"0 has; every partition{' and the test' if with_test else ''} needs the same "
                f"columns (it has {', '.join(has) or 'none'})"
            )


def _frame_of(data: Any, where: str) -> Any:
    """A partition (``datasets.Dataset``) or a DataFrame as a pandas DataFrame."""
    import pandas as pd

    if isinstance(data, pd.DataFrame):
        return data
    to_pandas = getattr(data, "to_pandas", None)  # duck-typed: datasets is optional
    if to_pandas is None:
        raise DataError(f"{where}: expected a datasets.Dataset or DataFrame, got {type(data)}")
    frame = to_pandas()
    if not isinstance(frame, pd.DataFrame):  # a batched iterator: not a partition
        raise DataError(f"{where}: its to_pandas() gave a {type(frame).__name__}")
    return frame


def _table_options(options: Mapping[str, Any]) -> TableOptions:
    """The table loader's options from keyword arguments, checked by the rules a config
    file's ``[data]`` keys are (keys.py: types, ranges, lists; a single string where a list
    belongs is a one-element list)."""
    table: TableOptions = parse_section(
        TableOptions, "", dict(options), context=" (the table loader's options)"
    )
    return table


def _array(value: Any, what: str) -> np.ndarray:
    """``value`` as a numpy array, or an error naming ``what`` (ragged nesting, objects)."""
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as error:
        raise ArgumentError(
            f"{what} must be an array of numbers, got {_shape(value)} ({error})"
        ) from None


def _seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ArgumentError(f"seed must be an integer >= 0, got {seed!r}")
    return int(seed)


def _sample_sets(name: str, clients: Any) -> list[SampleSet]:
    """``from_clients``'s clients: a list (or other sequence) of ``SampleSet`` s."""
    if isinstance(clients, (str, bytes, Mapping)) or not isinstance(clients, Sequence):
        raise ArgumentError(
            f"{name}: clients must be a list of SampleSets (one per client, from "
            f"fedsub.samples), got {_shape(clients)}"
        )
    for k, client in enumerate(clients):
        if not isinstance(client, SampleSet):
            raise ArgumentError(
                f"{name}: clients[{k}] must be a SampleSet (fedsub.samples(labels, ids=...)), "
                f"got {_shape(client)}"
            )
    return list(clients)


def _check_test(name: str, test: Any, first: SampleSet) -> None:
    """The test split: a ``SampleSet`` with the clients' fields and dense width."""
    if not isinstance(test, SampleSet):
        raise ArgumentError(
            f"{name}: test must be a SampleSet (fedsub.samples(...)) or None, got {_shape(test)}"
        )
    if set(test.ids) != set(first.ids) or test.dense_dim != first.dense_dim:
        raise DataError(
            f"{name}: test has fields {sorted(test.ids)} and {test.dense_dim} dense features; "
            f"the clients have {sorted(first.ids)} and {first.dense_dim}"
        )


def _check_labels(name: str, clients: list[SampleSet]) -> None:
    """Training labels of one value teach a model nothing (the table loader refuses them)."""
    values = np.unique(np.concatenate([c.labels for c in clients]))
    if len(values) == 1:
        raise DataError(
            f"{name}: every training label is {values[0]:g}; a model learns nothing from one "
            "label value (give samples of both classes)"
        )


def _field_tables(name: str, given: Any, first: SampleSet) -> dict[str, str]:
    """``field_tables``: a dict from a field of the samples to the table it reads."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise ArgumentError(
            f"{name}: field_tables must be a dict from field to table name, got {_shape(given)}"
        )
    for field, table in given.items():
        if field not in first.ids:
            raise ArgumentError(
                f"{name}: field_tables names field {field!r}, which the samples do not have "
                f"(their fields: {', '.join(sorted(first.ids)) or 'none'})"
            )
        if not isinstance(table, str) or not table:
            raise ArgumentError(
                f"{name}: field_tables[{field!r}] must be a table's name (a string), got {table!r}"
            )
    return dict(given)


def _given_rows(name: str, given: Any) -> dict[str, int] | None:
    """``table_rows``: a dict from table to its number of rows (an integer >= 1)."""
    if given is None:
        return None
    if not isinstance(given, Mapping):
        raise ArgumentError(
            f"{name}: table_rows must be a dict from table name to rows, got {_shape(given)}"
        )
    rows = {}
    for table, count in given.items():
        integer = isinstance(count, (int, np.integer)) and not isinstance(count, (bool, np.bool_))
        if not integer or count < 1:
            raise ArgumentError(
                f"{name}: table_rows[{table!r}] must be an integer >= 1, got {count!r}"
            )
        rows[table] = int(count)
    return rows


def _cell(value: Any, separator: str) -> Cell:
    """A DataFrame cell as the table loader reads it: a list stays a list (a multi-hot
    column's values, as a Parquet list column's; elsewhere refused by the loader), anything
    else its text."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_text(v, separator) for v in value]
    return _text(value, separator)


def _text(value: Any, separator: str) -> str:
    """A cell as the table loader reads text: lists joined by the separator (multi-hot),
    missing values empty, booleans 1 / 0."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return separator.join(_text(v, separator) for v in value)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, (bool, np.bool_)):
        return "1" if value else "0"
    text = str(value)
    return "" if text in ("<NA>", "NaT") else text


def _ragged(where: str, value: Any, n: int) -> Ragged:
    if isinstance(value, Ragged):
        ragged = value
    elif isinstance(value, (list, tuple)) and (not value or any(_is_list(r) for r in value)):
        try:
            ragged = Ragged.from_lists([[_integer(i) for i in row] for row in value])
        except (TypeError, ValueError):
            raise DataError(f"{where}: expected lists of integer ids") from None
    else:
        array = np.asarray(value)
        if array.ndim not in (1, 2) or not np.issubdtype(array.dtype, np.integer):
            raise DataError(
                f"{where}: expected integer ids ([n], [n, L] or n lists), got {_shape(value)}"
            )
        ragged = Ragged.from_fixed(array[:, None] if array.ndim == 1 else array)
    if len(ragged) != n:
        raise DataError(f"{where}: {len(ragged)} samples, the labels have {n}")
    if len(ragged.values) and ragged.values.min() < 0:
        raise DataError(f"{where}: ids must be >= 0, got {int(ragged.values.min())}")
    return ragged


def _is_list(row: Any) -> bool:
    return isinstance(row, (list, tuple, np.ndarray))


def _integer(value: Any) -> int:
    """An id: an integer (a float or text is refused, not rounded)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(value)
    return int(value)


def _table_rows(
    name: str,
    parts: list[SampleSet],
    field_tables: dict[str, str],
    given: Mapping[str, int] | None,
) -> dict[str, int]:
    """Each table's rows: the largest id any field reading it holds, + 1, or ``given``."""
    needed: dict[str, int] = {}
    held: dict[str, int] = {}
    for part in parts:
        for field, ragged in part.ids.items():
            table = field_tables.get(field, field)
            largest = int(ragged.values.max()) + 1 if len(ragged.values) else 1
            needed[table] = max(needed.get(table, 1), largest)
            held[table] = held.get(table, 0) + len(ragged.values)
    if given is None:
        for table, rows in needed.items():
            if rows > max(AUTO_ROWS, SPARSE_FACTOR * held[table]):
                raise DataError(
                    f"{name}: table {table!r} would get {rows} rows (its largest id is "
                    f"{rows - 1}) for {held[table]} ids; fedsub sizes a table from its ids only "
                    f"up to {AUTO_ROWS} rows or {SPARSE_FACTOR} per id held. Map the ids to "
                    f"0..rows-1, or give the size: table_rows={{{table!r}: {rows}}}"
                )
        return needed
    for table, rows in needed.items():
        if table not in given:
            raise DataError(f"{name}: table_rows gives no size for table {table!r}")
        if rows > given[table]:
            raise DataError(
                f"{name}: table {table!r} has {given[table]} rows (table_rows) but an id "
                f"{rows - 1} is read from it"
            )
    unused = sorted(set(given) - set(needed))
    if unused:
        raise DataError(f"{name}: table_rows names {unused[0]!r}, which no field reads")
    return dict(given)


def _empty_like(part: SampleSet) -> SampleSet:
    empty = Ragged(np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
    dense = None if part.dense is None else np.zeros((0, part.dense_dim), dtype=np.float32)
    return SampleSet({f: empty for f in part.ids}, np.zeros(0, dtype=np.float32), dense)


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"a {type(value).__name__}" + ("" if shape is None else f" of shape {tuple(shape)}")
