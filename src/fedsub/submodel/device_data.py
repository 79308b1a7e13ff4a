"""The training data a round reads, as torch tensors on the run's device, built once per run.

Numpy is for loading and reporting; the round (engine/cohort_batches.py for the batched
backend, engine/sequential.py) gathers everything from this view: per field the training ids
rewritten as positions in their client's S(k), labels and dense features in the run's dtype,
client offsets and sample counts, and every client's S(k) per table. On the CPU the id arrays
share the numpy arrays' memory (no copy); on a GPU everything is copied there once. The
host keeps the per-client sizes (sample counts, |S(k)|) as numpy arrays, so a round sizes its
tensors from the cohort's client ids without reading the device (no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedsub.data.federated import FederatedDataset
from fedsub.data.ragged import Ragged
from fedsub.data.torch_ragged import TorchRagged
from fedsub.submodel.index import SubmodelIndex


@dataclass(frozen=True)
class HostSizes:
    """The per-client sizes as host numbers: a round sizes its tensors from them and the
    cohort's client ids without reading the device (no host sync)."""

    samples: np.ndarray  # [N] the sample counts
    rows: dict[str, np.ndarray]  # per table, [N] |S(k)|


@dataclass(frozen=True)
class DeviceData:
    device: torch.device
    dtype: torch.dtype
    local_ids: dict[str, TorchRagged]  # per field, over all training samples
    labels: torch.Tensor  # [n] in ``dtype``
    dense: torch.Tensor | None  # [n, d] in ``dtype``
    client_offsets: torch.Tensor  # [N + 1]
    counts: torch.Tensor  # [N] sample counts w_k (int64)
    rows: dict[str, TorchRagged]  # per table, over clients: S(k)
    field_tables: dict[str, str]  # every field -> the table it reads
    host: HostSizes  # the sample counts and |S(k)| again, on the host

    @staticmethod
    def build(
        dataset: FederatedDataset, index: SubmodelIndex, device: torch.device, dtype: torch.dtype
    ) -> DeviceData:
        train = dataset.train
        offsets = torch.from_numpy(dataset.client_offsets).to(device)
        return DeviceData(
            device=device,
            dtype=dtype,
            local_ids={
                f: TorchRagged.of(Ragged(index.local_ids[f], r.offsets), device)
                for f, r in train.ids.items()
            },
            labels=torch.from_numpy(train.labels).to(device, dtype),
            dense=None if train.dense is None else torch.from_numpy(train.dense).to(device, dtype),
            client_offsets=offsets,
            counts=offsets[1:] - offsets[:-1],
            rows={t: TorchRagged.of(r, device) for t, r in index.rows.items()},
            field_tables={f: dataset.table_of(f) for f in train.ids},
            host=HostSizes(
                samples=dataset.sample_counts(),
                rows={t: np.diff(r.offsets) for t, r in index.rows.items()},
            ),
        )

    @staticmethod
    def of(
        dataset: FederatedDataset, index: SubmodelIndex, device: torch.device, dtype: torch.dtype
    ) -> DeviceData:
        """The view of ``dataset`` / ``index``, built on first use and kept with the index (an
        index belongs to one dataset), so every round of a run reads the same tensors."""
        key = (id(dataset), str(device), dtype)
        view = index.views.get(key)
        if view is None or view[0] is not dataset:
            view = (dataset, DeviceData.build(dataset, index, device, dtype))
            index.views[key] = view
        return view[1]
