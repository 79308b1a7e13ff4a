"""Evaluation over row-sharded tables: each process scores its share of the samples.

An evaluation set is scored in fixed consecutive chunks (``engine/evaluate.py``'s
``eval_chunks``); process r takes its contiguous share of the chunks, fetches from their owners
the rows its chunks read (the sorted union of their ids per table), scores its chunks with the
ids renumbered into those rows, and every process gathers the outputs of all chunks in rank
order. A model reads table rows only through the ids it is given (models/base.py) and each
chunk is the one-process chunk, so the outputs, and the losses, accuracies and AUC computed
from them, are exactly one process's; no process fetches more than its chunks' rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from fedsub import distributed
from fedsub.data.federated import SampleSet
from fedsub.data.ragged import Ragged
from fedsub.models.base import Batch, Model, forward
from fedsub.sharding.rounds import ShardedTables
from fedsub.submodel.params import Params


def rows_read(sets: list[SampleSet], tables: list[str]) -> dict[str, np.ndarray]:
    """Per table, the sorted union of the ids of every sample of ``sets``."""
    empty = np.zeros(0, dtype=np.int64)
    return {t: np.unique(np.concatenate([empty, *(s.ids[t].values for s in sets)])) for t in tables}


def renumbered(samples: SampleSet, rows: dict[str, np.ndarray]) -> SampleSet:
    """``samples`` with each id replaced by its position in ``rows[t]`` (which holds it)."""
    ids = {
        t: Ragged(np.searchsorted(rows[t], r.values).astype(np.int64), r.offsets)
        for t, r in samples.ids.items()
    }
    return SampleSet(ids, samples.labels, samples.dense)


@dataclass
class ShardedScoring:
    """The model's outputs on an evaluation set, each process scoring its share of the chunks
    (an ``Evaluator``'s ``outputs_of``; a collective: every process evaluates together)."""

    sharded: ShardedTables
    model: Model
    chunks: Callable[[Model, SampleSet], list[SampleSet]]
    # per evaluation set (by identity): the rows its share of chunks reads, and those chunks
    # renumbered into them
    prepared: dict[int, tuple[SampleSet, dict[str, np.ndarray], list[SampleSet]]] = field(
        default_factory=dict
    )

    def _share(self, samples: SampleSet, tables: list[str]):
        cached = self.prepared.get(id(samples))
        if cached is None or cached[0] is not samples:
            chunks = self.chunks(self.model, samples)
            mine = [chunks[i] for i in self.sharded.processes.share(len(chunks))]
            rows = rows_read(mine, tables)
            cached = (samples, rows, [renumbered(c, rows) for c in mine])
            self.prepared[id(samples)] = cached
        return cached[1], cached[2]

    def __call__(self, params: Params, samples: SampleSet) -> torch.Tensor:
        rows, mine = self._share(samples, list(params.tables))
        device = params.device
        dtype = params.tensors()[0].dtype
        what = "fetching the evaluation's rows"
        tables = {
            t: self.sharded.fetch(params, t, torch.from_numpy(rows[t]).to(device), what)
            for t in params.tables
        }
        local = Params(tables, dict(params.dense))
        with torch.no_grad():
            outputs = [
                forward(self.model, local, Batch.from_samples(c, dtype, device)) for c in mine
            ]
        part = torch.cat(outputs).cpu() if outputs else None
        parts = distributed.all_gather(part, "gathering the evaluation's outputs")
        scored = [p for p in parts if p is not None]
        if not scored:  # an empty set
            return torch.zeros(0, dtype=dtype, device=device)
        return torch.cat(scored).to(device)
