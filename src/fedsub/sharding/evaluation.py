"""Evaluation over row-sharded tables: the rows the evaluation sets read, fetched.

The evaluation sets are fixed for the run, so the rows they read are too: per table the sorted
union of their ids, found once. Each evaluation fetches those rows from their owners, and the
sets are scored with their ids renumbered to positions in the union. A model reads table rows
only through the ids it is given (models/base.py), and the chunks and the order of the samples
are the one-process evaluation's, so the metrics are exactly one process's.
"""

from __future__ import annotations

import numpy as np

from fedsub.data.federated import SampleSet
from fedsub.data.ragged import Ragged


def rows_read(sets: list[SampleSet]) -> dict[str, np.ndarray]:
    """Per table, the sorted union of the ids of every sample of ``sets``."""
    tables = sets[0].ids.keys() if sets else []
    return {t: np.unique(np.concatenate([s.ids[t].values for s in sets])) for t in tables}


def renumbered(samples: SampleSet, rows: dict[str, np.ndarray]) -> SampleSet:
    """``samples`` with each id replaced by its position in ``rows[t]`` (which holds it)."""
    ids = {
        t: Ragged(np.searchsorted(rows[t], r.values).astype(np.int64), r.offsets)
        for t, r in samples.ids.items()
    }
    return SampleSet(ids, samples.labels, samples.dense)
