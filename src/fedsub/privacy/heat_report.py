"""The private heat exchange's result (``HeatReport``), and it as a checkpoint stage, so a
private run can resume.

A run with a private ``privacy.heat_source`` (every ``privacy.level`` level from ``heat`` up)
measures the heat once, by a secure exchange with every counted node (privacy/secure_sum.py).
A resumed run must not exchange again: the nodes online then may differ, and a new exchange
would give other noise (sketch, randomized response) than the rounds already run used. So the
report (per table the heat of every row, the population's totals, the contributing nodes) is
saved with the other stages of a checkpoint and restored on resume. Nothing else of a private
round lives across rounds: requests are keyed by (seed, round, client), a held row left out of
a request is skipped (no node keeps rows), and a secure sum's session and a node's pending
deltas last one round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedsub.files.tensor_files import unsigned_ids, unsigned_ids_tensor
from fedsub.privacy.heat_vectors import MeasuredHeat


@dataclass(frozen=True)
class HeatReport:
    """The heat the exchange measured, and whose contribution it holds (node ids)."""

    measured: MeasuredHeat
    contributors: tuple[int, ...]


class PrivateHeatStage:
    """The runtime's heat report (None until measured or restored), a ``Stateful``."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.report: HeatReport | None = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        report = self.report
        if report is None:
            raise ValueError("private heat: nothing measured yet to checkpoint")
        measured = report.measured
        tensors = {f"heat.{t}": torch.from_numpy(h.copy()) for t, h in measured.heat.items()}
        tensors["totals"] = torch.tensor(
            [measured.total_samples, float(measured.num_clients), measured.lowest_weight],
            dtype=torch.float64,
        )
        tensors["contributors"] = unsigned_ids_tensor(report.contributors)  # Flower's: uint64
        return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if "totals" not in tensors or "contributors" not in tensors:
            raise ValueError(
                f"private heat: expected totals and contributors, got {sorted(tensors)}"
            )
        total, clients, lowest = tensors["totals"].tolist()
        heat = {
            key.removeprefix("heat."): np.asarray(value.numpy(), dtype=np.float64)
            for key, value in tensors.items()
            if key.startswith("heat.")
        }
        measured = MeasuredHeat(self.source, heat, float(total), int(clients), float(lowest))
        contributors = tuple(unsigned_ids(tensors["contributors"]))
        self.report = HeatReport(measured, contributors)
