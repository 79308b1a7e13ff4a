"""g5's baseline: the per-client loop a user would write in plain torch, without fedsub.

FedSubAvg with sample-weighted coefficients on embedding-LR (sum-pooled rows + a linear head):
clients one after another on the same device, each pulling its rows, running I steps of
plain autograd SGD on B samples, and pushing its weighted deltas; the server adds them up,
scales each row by its heat coefficient and applies them. It shares nothing with fedsub's
engine but the cohort draw and each client's sample order (``cohort_schedules``), so that it
trains on the same data; the heat coefficients are computed here, from the data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedsub.data.federated import FederatedDataset
from fedsub.engine.shuffle import cohort_schedules


@dataclass
class PlainFederation:
    """The training data as the user would keep it on the device: ids [n, L] (every sample
    has L ids), labels, client offsets; and FedSubAvg's per-row coefficients."""

    ids: torch.Tensor
    labels: torch.Tensor
    offsets: np.ndarray
    coefficients: torch.Tensor  # [rows]: total samples / samples of the clients touching it

    @staticmethod
    def of(dataset: FederatedDataset, device: torch.device, dtype: torch.dtype) -> PlainFederation:
        (table,) = dataset.table_rows
        ragged = dataset.train.ids[table]
        width = int(ragged.offsets[1] - ragged.offsets[0]) if len(ragged) else 0
        if not np.array_equal(np.diff(ragged.offsets), np.full(len(ragged), width)):
            raise ValueError("the plain loop expects the same number of ids in every sample")
        ids = ragged.values.reshape(-1, width)
        counts = np.diff(dataset.client_offsets)
        owner = np.repeat(np.arange(dataset.num_clients), counts * width)
        # (client, row) pairs, each once: the clients touching a row, weighted by their samples
        pairs = np.unique(owner * np.int64(dataset.table_rows[table]) + ids.reshape(-1))
        touching = pairs // dataset.table_rows[table]
        row = pairs % dataset.table_rows[table]
        heat = np.bincount(
            row, weights=counts[touching].astype(np.float64), minlength=dataset.table_rows[table]
        )
        coefficients = np.where(heat > 0, counts.sum() / np.maximum(heat, 1e-300), 1.0)
        return PlainFederation(
            torch.from_numpy(ids).to(device),
            torch.from_numpy(dataset.train.labels).to(device, dtype),
            dataset.client_offsets,
            torch.from_numpy(coefficients).to(device),
        )


def plain_round(
    table: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    data: PlainFederation,
    clients: np.ndarray,
    seed: int,
    round_index: int,
    steps: int,
    batch: int,
    lr: float,
) -> None:
    """One FedSubAvg round of ``clients`` (a uniform cohort, each drawn once), in place."""
    device = table.device
    counts = data.offsets[clients + 1] - data.offsets[clients]
    share = counts / counts.sum()  # sample-weighted client weights
    pushed_rows, pushed, dense_sum = [], [], [torch.zeros_like(weight), torch.zeros_like(bias)]
    for k, count, a_k in zip(clients.tolist(), counts.tolist(), share.tolist(), strict=True):
        start = int(data.offsets[k])
        order = cohort_schedules(
            seed, round_index, torch.tensor([k]), torch.tensor([count]), steps, batch
        )[0].to(device)  # [steps, B] local sample indices, fedsub's seeded shuffle
        client_ids = data.ids[start : start + count]
        rows, local_ids = torch.unique(client_ids, return_inverse=True)
        local = table[rows].clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        b = bias.clone().requires_grad_(True)
        for step in range(steps):
            samples = order[step]
            pooled = local[local_ids[samples]].sum(1)  # [B, dim]
            logits = pooled @ w + b
            loss = F.binary_cross_entropy_with_logits(logits, data.labels[start + samples])
            loss.backward()
            with torch.no_grad():
                for p in (local, w, b):
                    p -= lr * p.grad
                    p.grad = None
        with torch.no_grad():
            pushed_rows.append(rows)
            pushed.append(a_k * (local - table[rows]))
            dense_sum[0] += a_k * (w - weight)
            dense_sum[1] += a_k * (b - bias)
    with torch.no_grad():
        all_rows = torch.cat(pushed_rows)
        deltas = torch.cat(pushed) * data.coefficients[all_rows].to(table.dtype)[:, None]
        table.index_add_(0, all_rows, deltas)
        weight += dense_sum[0]
        bias += dense_sum[1]
