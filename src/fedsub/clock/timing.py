"""How long a client's work takes on the virtual clock.

A client k that trains in a round spends

    t_k = down_k / download_k + samples_k / compute_k + up_k / upload_k

seconds: download its model, train ``samples_k = local_steps * batch_size`` samples (every
local step is one batch), upload its update. ``down_k = up_k`` are the bytes of what it
exchanges: its submodel's rows (sum over tables of |S(k)| * dim * itemsize) plus the dense
parameters, or the whole model (every row of every table). The server's own time is not
counted (it is small against a client's and the same for every algorithm).
"""

from __future__ import annotations

import numpy as np

from fedsub.clock.profiles import Profiles
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params


def submodel_bytes(index: SubmodelIndex, params: Params, num_clients: int) -> np.ndarray:
    """Each client's submodel in bytes: its rows of every table and the dense parameters."""
    dense = sum(v.numel() * v.element_size() for v in params.dense.values())
    total = np.full(num_clients, float(dense))
    for table, rows in index.rows.items():
        values = params.tables[table]
        row_bytes = values[0].numel() * values.element_size() if len(values) else 0
        total += np.diff(rows.offsets).astype(np.float64) * row_bytes
    return total


def whole_model_bytes(params: Params, num_clients: int) -> np.ndarray:
    """The whole model in bytes, for each of ``num_clients`` clients."""
    tensors = [*params.tables.values(), *params.dense.values()]
    return np.full(num_clients, float(sum(v.numel() * v.element_size() for v in tensors)))


def work_seconds(
    profiles: Profiles, exchanged: np.ndarray, samples: float, clients: np.ndarray
) -> np.ndarray:
    """``t_k`` of each of ``clients`` (module docstring): ``exchanged`` bytes each way,
    ``samples`` trained."""
    return (
        exchanged[clients] / profiles.download[clients]
        + samples / profiles.compute[clients]
        + exchanged[clients] / profiles.upload[clients]
    )
