"""A shared, versioned feature spec: how every node turns its raw values into row ids.

On a real federation no one may load everyone's data to build vocabularies, so the row ids
and the table sizes (and with them the model) come from a small JSON file that the server and
every node hold alike::

    {"format": 1, "version": 3, "label": "label", "list_separator": "|",
     "fields": [{"column": "item", "buckets": 4096},
                {"column": "tags", "buckets": 512, "multi_hot": true},
                {"column": "item*country", "buckets": 2048},
                {"column": "country", "vocabulary": ["de", "fr", "it"]},
                {"column": "city", "vocabulary_file": "cities.txt"}],
     "numeric": [{"column": "price", "mean": 12.5, "std": 4.0}]}

Each field is a block of rows of the one shared table ``features`` (as in data/table.py):

- ``buckets``: hashed ids, row = blake2b("<column>:<value>") mod buckets. The hash is stable
  across processes and machines (never Python's salted ``hash``); distinct values may share a
  row (a collision), which is the price of needing no vocabulary;
- ``vocabulary`` (inline) or ``vocabulary_file`` (one value per line, relative to the spec's
  folder: a file the server publishes): the values in row order, starting at row 1; row 0 is
  reserved for values not in it;
- a column ``a*b`` crosses two columns (one id per pair of values; hashed only).

``numeric`` columns are dense features, standardized with the given ``mean`` / ``std`` (the
nodes cannot compute shared statistics from their own data). ``version`` is the spec's own
revision number; ``hash`` is the SHA-256 of its canonical content (vocabularies included), and
a node whose spec hash differs from the run's is refused, naming both (``check_same_spec``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged
from fedsub.data.table import TABLE, Cell, read_rows
from fedsub.errors import DataError
from fedsub.files.atomic_files import write_atomic

FORMAT = 1  # the layout of the spec file this module reads and writes
UNKNOWN_ROW = 0  # a vocabulary field's row for values not in its vocabulary


def hashed_row(column: str, value: str, buckets: int) -> int:
    """The stable hashed row of ``value`` in a field of ``buckets`` rows."""
    digest = hashlib.blake2b(f"{column}:{value}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % buckets


@dataclass(frozen=True)
class FieldSpec:
    """One categorical column (or an ``a*b`` cross): hashed ``buckets`` or a ``vocabulary``."""

    column: str
    buckets: int = 0
    vocabulary: tuple[str, ...] = ()
    multi_hot: bool = False

    @property
    def rows(self) -> int:
        return self.buckets if self.buckets else len(self.vocabulary) + 1

    @property
    def crossed(self) -> tuple[str, str] | None:
        a, star, b = self.column.partition("*")
        return (a, b) if star else None

    def row_of(self, value: str, positions: dict[str, int]) -> int:
        """The field's row (0-based within its block) for a raw value; ``positions`` is the
        vocabulary's value -> row map (empty for hashed fields)."""
        if self.buckets:
            return hashed_row(self.column, value, self.buckets)
        return positions.get(value, UNKNOWN_ROW)

    def describe(self) -> dict[str, Any]:
        kind: dict[str, Any] = (
            {"buckets": self.buckets} if self.buckets else {"vocabulary": list(self.vocabulary)}
        )
        return {"column": self.column, **kind, "multi_hot": self.multi_hot}


@dataclass(frozen=True)
class NumericSpec:
    column: str
    mean: float = 0.0
    std: float = 1.0


@dataclass(frozen=True)
class FeatureSpec:
    """The fields, their rows in the table ``features``, the label and the numeric columns."""

    version: int
    fields: tuple[FieldSpec, ...]
    label: str = "label"
    numeric: tuple[NumericSpec, ...] = ()
    list_separator: str = "|"
    source: str = ""  # the file it was read from (for messages; not part of the content)

    @property
    def table_rows(self) -> dict[str, int]:
        return {TABLE: sum(f.rows for f in self.fields)}

    def content(self) -> dict[str, Any]:
        """What the spec says, as JSON values: what is written, and what the hash covers."""
        return {
            "format": FORMAT,
            "version": self.version,
            "label": self.label,
            "list_separator": self.list_separator,
            "fields": [f.describe() for f in self.fields],
            "numeric": [{"column": n.column, "mean": n.mean, "std": n.std} for n in self.numeric],
        }

    @cached_property  # vocabularies may be long; every message's check asks for it
    def hash(self) -> str:
        canonical = json.dumps(self.content(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def name(self) -> str:
        """How messages name this spec: version and the hash's first 12 digits."""
        where = f" ({self.source})" if self.source else ""
        return f"version {self.version}, hash {self.hash[:12]}{where}"

    def write(self, path: Path) -> None:
        """Write the spec (with its hash) atomically: a reader never sees half a file."""
        write_atomic(path, json.dumps({**self.content(), "hash": self.hash}, indent=2) + "\n")

    def template(self, num_clients: int) -> FederatedDataset:
        """A dataset of the spec's shape for sizing a model: ``num_clients`` clients of one
        placeholder sample each (every id 0, labels 0 and 1). It holds no one's data."""
        fields = {TABLE: Ragged.from_lists([[0] for _ in range(num_clients)])}
        dense = np.zeros((num_clients, len(self.numeric)), np.float32) if self.numeric else None
        labels = (np.arange(num_clients) % 2).astype(np.float32)
        placeholder = SampleSet(fields, labels, dense)
        offsets = np.arange(num_clients + 1, dtype=np.int64)
        return FederatedDataset(
            "feature-spec", self.table_rows, placeholder, offsets, placeholder.take(np.arange(0))
        )

    def encode(self, file: Path) -> SampleSet:
        """A file's samples (the table CSV / Parquet of data/table.py: a header, one row per
        sample) with row ids from this spec; other columns (e.g. a client id) are ignored."""
        header, rows, unit = read_rows(file)
        first = 2 if unit == "line" else 0

        def where(i: int) -> str:
            return f"{file}, {unit} {i + first}"

        columns = [self.label, *(n.column for n in self.numeric)]
        for f in self.fields:
            columns += list(f.crossed or (f.column,))
        missing = [c for c in dict.fromkeys(columns) if c not in header]
        if missing:
            raise DataError(
                f"{file}: no column {missing[0]!r} (the feature spec {self.name()} needs it); "
                f"columns are {', '.join(header)}"
            )
        if not rows:
            raise DataError(f"{file}: no data rows")
        position = {c: header.index(c) for c in columns}
        vocabularies = [{v: i + 1 for i, v in enumerate(f.vocabulary)} for f in self.fields]
        starts = np.r_[0, np.cumsum([f.rows for f in self.fields])].astype(np.int64)
        labels = np.empty(len(rows), np.float32)
        dense = np.empty((len(rows), len(self.numeric)), np.float64)
        ids: list[list[int]] = []
        for i, row in enumerate(rows):
            labels[i] = _label(
                _single(row[position[self.label]], where(i), self.label), where(i), self.label
            )
            for j, n in enumerate(self.numeric):
                text = _single(row[position[n.column]], where(i), n.column)
                dense[i, j] = (_number(text, where(i), n.column) - n.mean) / n.std
            sample = []
            for f, start, vocabulary in zip(self.fields, starts[:-1], vocabularies, strict=True):
                for value in self._values(f, row, position, where(i)):
                    sample.append(int(start) + f.row_of(value, vocabulary))
            ids.append(sample)
        return SampleSet(
            {TABLE: Ragged.from_lists(ids)},
            labels,
            dense.astype(np.float32) if self.numeric else None,
        )

    def _values(
        self, f: FieldSpec, row: list[Cell], position: dict[str, int], where: str
    ) -> list[str]:
        def values(column: str) -> list[str]:
            cell = row[position[column]]
            if f.multi_hot and isinstance(cell, list):  # a Parquet list column
                return [v for v in cell if v]
            text = _single(cell, where, column)
            if f.multi_hot:
                return [v for v in text.split(self.list_separator) if v]
            return [text]

        crossed = f.crossed
        if crossed is None:
            return values(f.column)
        return [f"{x}\x1f{y}" for x in values(crossed[0]) for y in values(crossed[1])]


def _single(cell: Cell, where: str, column: str) -> str:
    """A cell that must hold one value (not a Parquet list)."""
    if isinstance(cell, list):
        raise DataError(f"{where}: {column} holds a list ({cell!r}); expected one value")
    return cell


def _label(text: str, where: str, column: str) -> float:
    if text.strip() not in ("0", "1", "0.0", "1.0"):
        raise DataError(f"{where}: {column} must be 0 or 1, got {text!r}")
    return float(text)


def _number(text: str, where: str, column: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise DataError(f"{where}: {column} must be a number, got {text!r}") from None
    if not np.isfinite(value) or abs(value) > float(np.finfo(np.float32).max):
        raise DataError(f"{where}: {column} must be a finite float32 number, got {text!r}")
    return value


def check_same_spec(ours: FeatureSpec, run_version: int, run_hash: str, who: str) -> None:
    """Refuse a node whose spec is not the run's: its row ids would mean other values."""
    if ours.hash != run_hash:
        raise DataError(
            f"{who}: its feature spec is {ours.name()}, but the run's is version {run_version}, "
            f"hash {run_hash[:12]}; give every node the run's spec file"
        )


def read_spec(path: str | Path) -> FeatureSpec:
    """Read and check a spec file; errors name the file and the key or line at fault."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8-sig")  # a BOM is not data
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"feature spec {file}: cannot be read ({error})") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(
            f"feature spec {file}, line {error.lineno}: not valid JSON ({error.msg})"
        ) from None
    reader = _Reader(file)
    if not isinstance(raw, dict):
        raise DataError(f"feature spec {file}: expected a JSON object at the top")
    spec = reader.spec(raw)
    written = raw.get("hash")
    if written is not None and written != spec.hash:
        raise DataError(
            f"feature spec {file}: its hash {str(written)[:12]} does not match its content "
            f"(hash {spec.hash[:12]}): the file was edited or damaged; write it again"
        )
    return spec


@dataclass(frozen=True)
class _Reader:
    """Checks a spec's JSON values, naming the file and key of the first one at fault."""

    file: Path

    def fail(self, key: str, expected: str, value: object) -> DataError:
        return DataError(f"feature spec {self.file}: {key} = {value!r}; expected {expected}")

    def spec(self, raw: dict[str, Any]) -> FeatureSpec:
        known = {"format", "version", "label", "list_separator", "fields", "numeric", "hash"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise DataError(
                f"feature spec {self.file}: unknown key {unknown[0]!r}; "
                f"allowed: {', '.join(sorted(known))}"
            )
        if raw.get("format") != FORMAT:
            raise self.fail(
                "format", f"{FORMAT} (the spec layout this fedsub reads)", raw.get("format")
            )
        version = raw.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise self.fail("version", "an integer >= 1 (the spec's revision)", version)
        fields = raw.get("fields")
        if not isinstance(fields, list) or not fields:
            raise self.fail("fields", "a non-empty list of fields", fields)
        parsed = tuple(self.field(f, i) for i, f in enumerate(fields))
        columns = [f.column for f in parsed]
        twice = sorted({c for c in columns if columns.count(c) > 1})
        if twice:
            raise DataError(f"feature spec {self.file}: fields list column {twice[0]!r} twice")
        numeric = raw.get("numeric", [])
        if not isinstance(numeric, list):
            raise self.fail("numeric", "a list of {column, mean, std}", numeric)
        return FeatureSpec(
            version=version,
            fields=parsed,
            label=self.text(raw, "label", "label"),
            numeric=tuple(self.numeric(n, i) for i, n in enumerate(numeric)),
            list_separator=self.text(raw, "list_separator", "|"),
            source=str(self.file),
        )

    def text(self, raw: dict[str, Any], key: str, default: str, where: str = "") -> str:
        value = raw.get(key, default)
        if not isinstance(value, str) or not value:
            raise self.fail(f"{where}{key}", "a non-empty string", value)
        return value

    def field(self, raw: object, i: int) -> FieldSpec:
        where = f"fields[{i}]."
        if not isinstance(raw, dict):
            raise self.fail(f"fields[{i}]", "an object with column and buckets or vocabulary", raw)
        known = {"column", "buckets", "vocabulary", "vocabulary_file", "multi_hot"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise DataError(
                f"feature spec {self.file}: unknown key {where}{unknown[0]}; "
                f"allowed: {', '.join(sorted(known))}"
            )
        column = self.text(raw, "column", "", where)
        kinds = [k for k in ("buckets", "vocabulary", "vocabulary_file") if k in raw]
        if len(kinds) != 1:
            raise DataError(
                f"feature spec {self.file}: {where[:-1]} (column {column!r}) needs exactly one "
                f"of buckets, vocabulary, vocabulary_file; it has {kinds or 'none'}"
            )
        multi_hot = raw.get("multi_hot", False)
        if not isinstance(multi_hot, bool):
            raise self.fail(f"{where}multi_hot", "true or false", multi_hot)
        if kinds[0] == "buckets":
            buckets = raw["buckets"]
            if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
                raise self.fail(f"{where}buckets", "an integer >= 1", buckets)
            return FieldSpec(column, buckets=buckets, multi_hot=multi_hot)
        if "*" in column:
            raise DataError(
                f"feature spec {self.file}: {where}column {column!r} is a cross; a cross "
                "takes hashed ids (buckets), not a vocabulary"
            )
        if kinds[0] == "vocabulary":
            values = raw["vocabulary"]
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise self.fail(f"{where}vocabulary", "a list of strings", values)
            self.check_unique(values, f"{where}vocabulary")
            return FieldSpec(column, vocabulary=tuple(values), multi_hot=multi_hot)
        name = self.text(raw, "vocabulary_file", "", where)
        return FieldSpec(column, vocabulary=self.vocabulary_file(name), multi_hot=multi_hot)

    def vocabulary_file(self, name: str) -> tuple[str, ...]:
        """One value per line (row 1, 2, ...), relative to the spec's folder."""
        file = (self.file.parent / name).expanduser()
        try:
            lines = file.read_text(encoding="utf-8-sig").splitlines()  # a BOM is not data
        except (OSError, UnicodeDecodeError) as error:
            raise DataError(
                f"feature spec {self.file}: vocabulary file {file} cannot be read ({error})"
            ) from None
        seen: dict[str, int] = {}
        for number, value in enumerate(lines, start=1):
            if not value:
                raise DataError(f"{file}, line {number}: empty value; expected one value a line")
            if value in seen:
                raise DataError(
                    f"{file}, line {number}: {value!r} repeats line {seen[value]}; "
                    "each value gets one row"
                )
            seen[value] = number
        return tuple(lines)

    def check_unique(self, values: list[str], key: str) -> None:
        seen: set[str] = set()
        for value in values:
            if value in seen:
                raise DataError(f"feature spec {self.file}: {key} lists {value!r} twice")
            seen.add(value)

    def numeric(self, raw: object, i: int) -> NumericSpec:
        where = f"numeric[{i}]."
        if not isinstance(raw, dict):
            raise self.fail(f"numeric[{i}]", "an object {column, mean, std}", raw)
        column = self.text(raw, "column", "", where)
        mean, std = raw.get("mean", 0.0), raw.get("std", 1.0)
        for key, value in (("mean", mean), ("std", std)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise self.fail(f"{where}{key}", "a number", value)
        if not std > 0:
            raise self.fail(f"{where}std", "a number > 0", std)
        return NumericSpec(column, float(mean), float(std))


@dataclass(frozen=True)
class NodeFiles:
    """A node's data: its file, and its held-out samples: a separate ``eval_file``, or a
    fraction of ``data_file``'s rows drawn with a fixed seed (the same rows on every read)."""

    data_file: Path
    eval_file: Path | None = None
    eval_fraction: float = 0.0
    eval_seed: int = 0

    def __post_init__(self) -> None:
        if self.eval_file is not None and self.eval_fraction:
            raise DataError(
                f"{self.data_file}: give the node an eval-file or an eval-fraction, not both"
            )
        if not 0.0 <= self.eval_fraction < 1.0:
            raise DataError(
                f"{self.data_file}: eval-fraction = {self.eval_fraction:g}; expected a number "
                "in [0, 1)"
            )

    def read(self, spec: FeatureSpec) -> tuple[SampleSet, SampleSet]:
        """(training samples, held-out samples), ids from ``spec``."""
        samples = spec.encode(self.data_file)
        if self.eval_file is not None:
            return samples, spec.encode(self.eval_file)
        held = np.random.default_rng([self.eval_seed, 0xE7A1]).random(len(samples))
        held_out = held < self.eval_fraction
        if held_out.all():
            raise DataError(
                f"{self.data_file}: eval-fraction = {self.eval_fraction:g} holds out all "
                f"{len(samples)} rows; nothing is left to train on"
            )
        return samples.take(np.flatnonzero(~held_out)), samples.take(np.flatnonzero(held_out))


def dataset_of_nodes(spec: FeatureSpec, nodes: list[NodeFiles]) -> FederatedDataset:
    """Several nodes' files as one in-process dataset (client k = node k), their held-out
    samples pooled as its test set: the in-process reference of a run whose nodes each hold
    their own file."""
    parts = [node.read(spec) for node in nodes]
    return FederatedDataset.from_clients(
        f"nodes:{spec.hash[:12]}",
        spec.table_rows,
        [train for train, _ in parts],
        SampleSet.concat([held_out for _, held_out in parts]),
    )


@dataclass(frozen=True)
class NodesOptions:
    """``data.name = "nodes"``: a Flower deployment's node-local data as one in-process
    dataset (client k = the node of ``partition-id`` k; every node's held-out samples pooled
    as the test set), so ``fedsub run`` gives the in-process reference of the deployment."""

    feature_spec: str = ""
    """The run's feature spec, the JSON file the ServerApp and every node hold (run config
    `feature-spec`)."""
    files: list[str] = field(default_factory=list)
    """Each node's data file (its node config's `data-file`), in partition-id order."""
    eval_files: list[str] = field(default_factory=list)
    """Each node's `eval-file` (`""`: none), in the same order; `[]`: no node has one."""
    eval_fraction: float = field(default=0.0, metadata={"min": 0.0, "max": 0.99})
    """The share of each data file's rows held out (the nodes' `eval-fraction`)."""
    eval_seeds: list[int] = field(default_factory=list)
    """Each node's `eval-seed`, in the same order; `[]`: every node's is 0 (the default)."""


def load_nodes(options: NodesOptions) -> FederatedDataset:
    """The dataset of ``options`` (``dataset_of_nodes`` over its files and spec); paths are
    relative to the current folder. Lists of the wrong length are refused, naming them."""
    if not options.feature_spec or not options.files:
        raise DataError(
            'data.name = "nodes" needs data.feature_spec (the run\'s spec) and data.files '
            "(each node's data-file, in partition-id order)"
        )
    count = len(options.files)
    for name, values in (("eval_files", options.eval_files), ("eval_seeds", options.eval_seeds)):
        if values and len(values) != count:
            raise DataError(
                f"data.{name} has {len(values)} entries, data.files {count}: give one per node "
                "(or none)"
            )
    evals = options.eval_files or [""] * count
    seeds = options.eval_seeds or [0] * count
    nodes = [
        NodeFiles(
            Path(data).expanduser().absolute(),
            Path(held).expanduser().absolute() if held else None,
            0.0 if held else options.eval_fraction,
            seed,
        )
        for data, held, seed in zip(options.files, evals, seeds, strict=True)
    ]
    return dataset_of_nodes(read_spec(options.feature_spec), nodes)
