"""An LSTM layer over packed sequences for a whole cohort: K clients, each with its own
weights, B sequences each, and a hand-written backward pass.

Why: written with autograd, a cohort LSTM pads every sequence to the longest of the step,
runs ~15 small ops per time step and differentiates each of them, and accumulates the
recurrent weights' gradient one time step at a time. Here the sequences of each client are
sorted by length (longest first), so at time step t the sequences still running are a prefix
``rows[t]`` of every client's rows (``PackedPlan``); each step is one batched matmul over the
client axis on that prefix and a few element-wise ops, the backward pass reuses what the
forward pass kept, and the recurrent weights' gradient is one batched matmul over all steps.

Layout: time-major per client, ``[K, T, B, ...]``, rows in the plan's order. Positions past a
sequence's end hold values that nothing valid depends on (a sequence's step t reads only its
own steps before t), and the gradient reaching them is zero, so only each sequence's own steps
matter; ``PackedPlan.lengths`` says where each one ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.autograd.function import once_differentiable


@dataclass(frozen=True)
class PackedPlan:
    """Which rows run at each time step, from the sequences' lengths [K, B] (host ints).

    ``order[k]``: client k's sequences, longest first (a stable sort); ``lengths[k, j]``: the
    length of its j-th sequence in that order; ``rows[t]``: how many of every client's sorted
    rows run at step t (the most any client has still running); ``clients[t]``: how many
    leading clients have a row running."""

    order: np.ndarray  # [K, B] int64
    lengths: np.ndarray  # [K, B] int64, in ``order``
    rows: tuple[int, ...]  # per time step
    clients: tuple[int, ...]  # per time step

    @staticmethod
    def of(lengths: np.ndarray) -> PackedPlan:
        order = np.argsort(-lengths, axis=1, kind="stable")
        sorted_lengths = np.take_along_axis(lengths, order, axis=1)
        steps = int(sorted_lengths.max(initial=0))
        running = sorted_lengths[None, :, :] > np.arange(steps)[:, None, None]  # [T, K, B]
        per_client = running.sum(2)  # [T, K]: rows still running (a prefix: sorted)
        rows = per_client.max(1)
        anyone = per_client > 0
        # how many leading clients to compute: up to the last one with a row running
        clients = np.where(anyone.any(1), lengths.shape[0] - np.argmax(anyone[:, ::-1], 1), 0)
        return PackedPlan(
            order.astype(np.int64),
            sorted_lengths.astype(np.int64),
            tuple(int(r) for r in rows),
            tuple(int(c) for c in clients),
        )

    @property
    def steps(self) -> int:
        return len(self.rows)


class PackedRecurrence(torch.autograd.Function):
    """hs = recurrence(xp, w): xp [K, T, B, 4h] (input projection plus bias, gates in the
    order input, forget, cell, output), w [K, h, 4h] -> hs [K, T + 1, B, h], hs[:, 0] = 0 and
    hs[:, t + 1] the hidden state after step t (zero or unspecified past a sequence's end)."""

    @staticmethod
    def forward(ctx: Any, xp: torch.Tensor, w: torch.Tensor, plan: PackedPlan) -> torch.Tensor:
        k, steps, b, gates_width = xp.shape
        hidden = gates_width // 4
        hs = xp.new_zeros(k, steps + 1, b, hidden)
        c = xp.new_zeros(k, b, hidden)
        kept = []  # what each step's backward reads: all computed anyway, nothing extra
        for t, (clients, rows) in enumerate(zip(plan.clients, plan.rows, strict=True)):
            c = c[:clients, :rows]
            gates = torch.baddbmm(xp[:clients, t, :rows], hs[:clients, t, :rows], w[:clients])
            g = torch.tanh(gates[..., 2 * hidden : 3 * hidden])
            act = gates.sigmoid_()  # i, f, (unused), o
            i, f, o = act[..., :hidden], act[..., hidden : 2 * hidden], act[..., 3 * hidden :]
            c_next = torch.addcmul(f * c, i, g)
            tanh_c = torch.tanh(c_next)
            torch.mul(o, tanh_c, out=hs[:clients, t + 1, :rows])
            kept.append((act, g, c, tanh_c))
            c = c_next
        ctx.kept = kept
        ctx.plan = plan
        ctx.save_for_backward(w, hs)
        return hs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        w, hs = ctx.saved_tensors
        plan: PackedPlan = ctx.plan
        k, steps, b, hidden = hs.shape[0], hs.shape[1] - 1, hs.shape[2], hs.shape[3]
        d_gates = hs.new_zeros(k, steps, b, 4 * hidden)
        w_t = w.transpose(1, 2)
        # each step's gate gradients are formed in this small buffer, which stays in cache, and
        # copied once into their slice of d_gates: written there op by op (cold lines of a
        # 10 MB buffer) the element-wise ops cost about twice as much
        scratch = hs.new_empty(k * b, 4 * hidden)
        dh_next = dc_next = hs.new_zeros(0, 0, hidden)
        for t in range(steps - 1, -1, -1):
            clients, rows = plan.clients[t], plan.rows[t]
            act, g, c, tanh_c = ctx.kept[t]
            i, f, o = act[..., :hidden], act[..., hidden : 2 * hidden], act[..., 3 * hidden :]
            dh = grad_hs[:clients, t + 1, :rows]
            if dh_next.shape[:2] == (clients, rows):
                dh = dh + dh_next
                dc = torch.ops.aten.tanh_backward(dh * o, tanh_c).add_(dc_next)
            else:  # the step after ran a prefix of these rows: theirs go on, the rest start
                n_clients, n_rows = dh_next.shape[:2]
                dh = dh.clone()
                dh[:n_clients, :n_rows] += dh_next
                dc = torch.ops.aten.tanh_backward(dh * o, tanh_c)
                dc[:n_clients, :n_rows] += dc_next
            d = scratch[: clients * rows].view(clients, rows, 4 * hidden)  # before activations
            torch.mul(dc, g, out=d[..., :hidden])
            torch.mul(dc, c, out=d[..., hidden : 2 * hidden])
            torch.mul(dh, tanh_c, out=d[..., 3 * hidden :])
            torch.ops.aten.sigmoid_backward.grad_input(d, act, grad_input=d)
            cell = d[..., 2 * hidden : 3 * hidden]  # tanh's, not sigmoid's: redone from i
            torch.ops.aten.tanh_backward.grad_input(dc * i, g, grad_input=cell)
            dc_next = dc * f
            dh_next = torch.bmm(d, w_t[:clients])
            d_gates[:clients, t, :rows] = d
        h_before = hs[:, :steps].reshape(k, steps * b, hidden)
        d_w = torch.bmm(h_before.transpose(1, 2), d_gates.reshape(k, steps * b, 4 * hidden))
        return d_gates, d_w, None
