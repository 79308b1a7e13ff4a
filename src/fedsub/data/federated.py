"""A federated dataset: samples of ragged sparse ids (+ optional dense features), grouped by client.

Training samples are stored client after client, so client ``k`` owns the contiguous range
``client_offsets[k]:client_offsets[k + 1]``; its sample count ``w_k`` is the range's length.
The test set is pooled (the papers evaluate the global model on a central test set).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from fedsub.data.ragged import Ragged
from fedsub.errors import DataError


@dataclass(frozen=True)
class SampleSet:
    """Samples: per embedding table a ``Ragged`` of row ids, dense features, binary labels."""

    ids: dict[str, Ragged]
    labels: np.ndarray
    dense: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.labels)
        for table, ragged in self.ids.items():
            if len(ragged) != n:
                raise DataError(f"table {table!r} has {len(ragged)} samples, labels have {n}")
        if self.dense is not None and (self.dense.ndim != 2 or len(self.dense) != n):
            raise DataError(f"dense features must be [{n}, d], got {self.dense.shape}")

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def dense_dim(self) -> int:
        return 0 if self.dense is None else self.dense.shape[1]

    def take(self, index: np.ndarray) -> SampleSet:
        return SampleSet(
            ids={t: r.take(index) for t, r in self.ids.items()},
            labels=self.labels[index],
            dense=None if self.dense is None else self.dense[index],
        )

    def slice(self, start: int, stop: int) -> SampleSet:
        return SampleSet(
            ids={t: r.slice(start, stop) for t, r in self.ids.items()},
            labels=self.labels[start:stop],
            dense=None if self.dense is None else self.dense[start:stop],
        )

    @staticmethod
    def concat(parts: list[SampleSet]) -> SampleSet:
        tables = parts[0].ids.keys()
        dense = [p.dense for p in parts if p.dense is not None]
        if dense and len(dense) != len(parts):
            raise ValueError("SampleSet.concat: some parts have dense features, others none")
        return SampleSet(
            ids={t: Ragged.concat([p.ids[t] for p in parts]) for t in tables},
            labels=np.concatenate([p.labels for p in parts]),
            dense=np.concatenate(dense) if dense else None,
        )


class Population(Protocol):
    """What a server may know of a federation without its data: table sizes, client sizes."""

    @property
    def table_rows(self) -> dict[str, int]:
        """Read-only, so a frozen dataclass's ``table_rows`` field satisfies it."""
        ...

    @property
    def num_clients(self) -> int: ...

    def sample_counts(self) -> np.ndarray: ...


@dataclass(frozen=True)
class ClientSizes:
    """A ``Population`` reported by the clients themselves (e.g. a Flower query round)."""

    table_rows: dict[str, int]
    counts: np.ndarray

    @property
    def num_clients(self) -> int:
        return len(self.counts)

    def sample_counts(self) -> np.ndarray:
        return self.counts


@dataclass(frozen=True)
class FederatedDataset:
    """Clients' training data, a pooled test set, and the size of every embedding table.

    Samples hold ragged ids per *field*; each field reads one table (``field_tables``, by
    default the table of the field's own name). Several fields may share a table, e.g. a
    target item and the clicked-item history both index the item table."""

    name: str
    table_rows: dict[str, int]
    train: SampleSet
    client_offsets: np.ndarray
    test: SampleSet
    field_tables: dict[str, str] = field(default_factory=dict)
    # how dense features were standardized (table.py), written to the run's feature_scaling.json
    feature_scaling: dict | None = None

    def __post_init__(self) -> None:
        offsets = self.client_offsets
        if offsets[0] != 0 or offsets[-1] != len(self.train) or np.any(np.diff(offsets) <= 0):
            raise DataError(f"{self.name}: client offsets must split the training set, no empties")
        for split, samples in (("train", self.train), ("test", self.test)):
            if set(samples.ids) != set(self.train.ids):
                raise DataError(f"{self.name} {split}: fields {sorted(samples.ids)} differ")
            for name, ragged in samples.ids.items():
                table = self.table_of(name)
                if table not in self.table_rows:
                    raise DataError(f"{self.name}: field {name!r} reads unknown table {table!r}")
                rows = self.table_rows[table]
                if len(ragged.values) and (ragged.values.min() < 0 or ragged.values.max() >= rows):
                    raise DataError(
                        f"{self.name} {split}: field {name!r} ids must lie in [0, {rows})"
                    )
        unused = set(self.table_rows) - {self.table_of(f) for f in self.train.ids}
        if unused:
            raise DataError(f"{self.name}: no field reads table(s) {sorted(unused)}")

    def table_of(self, field_name: str) -> str:
        return self.field_tables.get(field_name, field_name)

    def fields_of(self, table: str) -> list[str]:
        return [f for f in self.train.ids if self.table_of(f) == table]

    @property
    def num_clients(self) -> int:
        return len(self.client_offsets) - 1

    def sample_counts(self) -> np.ndarray:
        """``w_k``: each client's number of training samples."""
        return np.diff(self.client_offsets)

    def client(self, k: int) -> SampleSet:
        return self.train.slice(int(self.client_offsets[k]), int(self.client_offsets[k + 1]))

    def client_of_sample(self) -> np.ndarray:
        """For every training sample, the client that holds it."""
        return np.repeat(np.arange(self.num_clients), self.sample_counts())

    @staticmethod
    def from_clients(
        name: str,
        table_rows: dict[str, int],
        clients: list[SampleSet],
        test: SampleSet,
        field_tables: dict[str, str] | None = None,
    ) -> FederatedDataset:
        offsets = np.zeros(len(clients) + 1, dtype=np.int64)
        np.cumsum([len(c) for c in clients], out=offsets[1:])
        return FederatedDataset(
            name, table_rows, SampleSet.concat(clients), offsets, test, field_tables or {}
        )
