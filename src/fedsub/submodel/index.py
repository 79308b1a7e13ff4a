"""Per-client index sets ``S(k)``: the sorted unique rows of each table a client's data touches.

Built once for all clients with one sort per table (O(nnz log nnz)). Alongside ``S(k)`` we keep
every training id rewritten as a position in its client's ``S(k)``, so a client's local model
is just the gathered rows ``X[S(k)]`` and its data indexes them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged


@dataclass(frozen=True)
class SubmodelIndex:
    """``rows[table]`` is a Ragged over clients: client k's ``S(k)`` for that table (the union
    over the fields reading it). ``local_ids[field]`` has the layout of
    ``train.ids[field].values``, holding positions in the client's S(k) of the field's table."""

    rows: dict[str, Ragged]
    local_ids: dict[str, np.ndarray]
    # torch views of the index and its dataset per device (submodel/device_data.py), built once
    views: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def build(dataset: FederatedDataset) -> SubmodelIndex:
        rows: dict[str, Ragged] = {}
        local_ids: dict[str, np.ndarray] = {}
        owner_of_sample = dataset.client_of_sample()
        for table, num_rows in dataset.table_rows.items():
            fields = dataset.fields_of(table)
            owners = [np.repeat(owner_of_sample, dataset.train.ids[f].lengths()) for f in fields]
            keys = [
                o * np.int64(num_rows) + dataset.train.ids[f].values
                for o, f in zip(owners, fields, strict=True)
            ]
            unique_keys = np.unique(np.concatenate(keys)) if keys else np.zeros(0, np.int64)
            counts = np.bincount(unique_keys // num_rows, minlength=dataset.num_clients)
            offsets = np.zeros(dataset.num_clients + 1, dtype=np.int64)
            np.cumsum(counts, out=offsets[1:])
            rows[table] = Ragged(unique_keys % num_rows, offsets)
            for f, key, owner in zip(fields, keys, owners, strict=True):
                local_ids[f] = np.searchsorted(unique_keys, key) - offsets[owner]
        return SubmodelIndex(rows, local_ids)

    @staticmethod
    def whole_model(dataset: FederatedDataset) -> SubmodelIndex:
        """Every client holds every row of every table (S(k) = all rows; local ids are the
        global ids): for algorithms that train the whole model on each client (exact
        SCAFFOLD). Memory: N x (table rows) ids per table."""
        rows, local_ids = {}, {}
        for table, num_rows in dataset.table_rows.items():
            clients = dataset.num_clients
            offsets = np.arange(clients + 1, dtype=np.int64) * num_rows
            rows[table] = Ragged(np.tile(np.arange(num_rows, dtype=np.int64), clients), offsets)
            for f in dataset.fields_of(table):
                local_ids[f] = dataset.train.ids[f].values.astype(np.int64)
        return SubmodelIndex(rows, local_ids)

    def client_rows(self, table: str, k: int) -> np.ndarray:
        """``S(k)`` for one table: sorted unique global row ids."""
        r = self.rows[table]
        return r.values[r.offsets[k] : r.offsets[k + 1]]

    def client_samples(self, dataset: FederatedDataset, k: int) -> SampleSet:
        """Client k's training samples with ids rewritten as positions in its submodel."""
        start, stop = int(dataset.client_offsets[k]), int(dataset.client_offsets[k + 1])
        global_view = dataset.train.slice(start, stop)
        ids = {}
        for name, ragged in dataset.train.ids.items():
            lo, hi = ragged.offsets[start], ragged.offsets[stop]
            ids[name] = Ragged(self.local_ids[name][lo:hi], global_view.ids[name].offsets)
        return SampleSet(ids, global_view.labels, global_view.dense)
