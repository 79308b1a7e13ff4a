"""A client's held rows S(k) under a private download request (privacy/requests.py): the
model it trains, where a held row left out of the request reads as zero (it is skipped that
round, as ``privacy/private_rounds.WithoutRows`` skips it in process), and the deltas it sends
back, of the requested held rows only (``privacy/private_rounds.restrict``). A Flower node runs
these (privacy/download_protocol.py).
"""

from __future__ import annotations

import numpy as np
import torch

from fedsub.errors import FedsubError
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import pull


def _requested(own: np.ndarray, request: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which of ``own`` (sorted) are in ``request`` (sorted), and their places in it."""
    at = np.minimum(np.searchsorted(request, own), max(len(request) - 1, 0))
    hit = request[at] == own if len(request) else np.zeros(len(own), dtype=bool)
    return hit, at


def local_submodel(
    held: dict[str, np.ndarray],
    client: int,
    rows: dict[str, torch.Tensor],
    received: Params,
    request: dict[str, np.ndarray],
) -> Params:
    """Client ``client``'s model over its ``held`` rows S(k) for training: requested rows as
    received (``rows``, or the whole model when it all came: no rows); held rows left out of
    the request read as zero (skipped this round, as in the simulator)."""
    own = {t: torch.from_numpy(r) for t, r in held.items()}
    if not rows:  # payload full: take S(k) from the whole model, then skip as below
        pulled = pull(received, own)
        tables = {}
        for t, values in pulled.tables.items():
            hit, _ = _requested(held[t], request[t])
            tables[t] = values.masked_fill(torch.from_numpy(~hit).unsqueeze(1), 0)
        return Params(tables, pulled.dense)
    for t, r in request.items():
        if t not in rows or not np.array_equal(rows[t].numpy(), r):
            raise FedsubError(f"partition {client}: the rows received are not its request")
    tables = {}
    for t, values in received.tables.items():
        hit, at = _requested(held[t], request[t])
        mine = values.new_zeros((len(held[t]), values.shape[1]))
        mine[torch.from_numpy(hit)] = values[torch.from_numpy(at[hit])]
        tables[t] = mine
    return Params(tables, {n: v.clone() for n, v in received.dense.items()})


def reply_record(
    own: dict[str, np.ndarray], request: dict[str, np.ndarray], table_deltas: dict
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The held rows the client requested and their deltas: a held row left out of the request
    is skipped this round (no update), as in the simulator."""
    rows, deltas = {}, {}
    for t, d in table_deltas.items():
        hit, _ = _requested(own[t], request[t])
        rows[t] = torch.from_numpy(own[t][hit])
        deltas[t] = d[torch.from_numpy(hit)]
    return rows, deltas
