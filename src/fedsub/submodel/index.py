"""Per-client index sets ``S(k)``: the sorted unique rows of each table a client's data touches.

Built once for all clients with one sort per table (O(nnz log nnz)). Alongside ``S(k)`` we keep
every training id rewritten as a position in its client's ``S(k)``, so a client's local model
is just the gathered rows ``X[S(k)]`` and its data indexes them directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged


@dataclass(frozen=True)
class SubmodelIndex:
    """``rows[table]`` is a Ragged over clients: client k's ``S(k)`` for that table.
    ``local_ids[table]`` has the layout of ``train.ids[table].values``, holding S(k) positions."""

    rows: dict[str, Ragged]
    local_ids: dict[str, np.ndarray]

    @staticmethod
    def build(dataset: FederatedDataset) -> SubmodelIndex:
        rows: dict[str, Ragged] = {}
        local_ids: dict[str, np.ndarray] = {}
        owner_of_sample = dataset.client_of_sample()
        for table, ids in dataset.train.ids.items():
            owner = np.repeat(owner_of_sample, ids.lengths())
            key = owner * np.int64(dataset.table_rows[table]) + ids.values
            unique_keys, inverse = np.unique(key, return_inverse=True)
            unique_owner = unique_keys // dataset.table_rows[table]
            counts = np.bincount(unique_owner, minlength=dataset.num_clients)
            offsets = np.zeros(dataset.num_clients + 1, dtype=np.int64)
            np.cumsum(counts, out=offsets[1:])
            rows[table] = Ragged(unique_keys % dataset.table_rows[table], offsets)
            local_ids[table] = inverse.reshape(-1) - offsets[owner]
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
        for table, ragged in dataset.train.ids.items():
            lo, hi = ragged.offsets[start], ragged.offsets[stop]
            ids[table] = Ragged(self.local_ids[table][lo:hi], global_view.ids[table].offsets)
        return SampleSet(ids, global_view.labels, global_view.dense)
