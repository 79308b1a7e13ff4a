"""SubmodelStrategy follows Flower's conventions: ``arrays`` / ``config`` in train messages,
``arrays`` / ``metrics`` with ``num-examples`` in replies (as flwr's FedAvg expects), nodes
register inside its own lifecycle (Flower's ``Strategy.start`` runs it with nothing else),
and Flower's DP wrappers, whose clipping and noise are defined on whole-model arrays, are
refused with the reason instead of silently adding no noise."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, MessageType
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)

from fedsub.errors import FedsubError

from .test_flower_membership import StandInGrid, strategy

pytestmark = pytest.mark.usefixtures("flower_task_identity")


def test_flowers_own_round_loop_runs_the_strategy_with_the_conventional_keys():
    grid = StandInGrid({100: 0, 101: 1, 102: 2})
    s = strategy()
    result = Strategy.start(s, grid, ArrayRecord(), num_rounds=2, timeout=1.0)  # flwr's loop
    train = [m for sent in grid.sent for m in sent if m.metadata.message_type == MessageType.TRAIN]
    assert len(train) == 6
    assert all(set(m.content.keys()) == {"arrays", "config"} for m in train)
    assert [r["replies"] for r in s.rounds] == [3, 3]
    assert float(s.params.tables["w"].abs().sum()) > 0
    assert sorted(result.train_metrics_clientapp) == [1, 2]


@pytest.mark.parametrize(
    "wrapper",
    [DifferentialPrivacyServerSideFixedClipping, DifferentialPrivacyClientSideFixedClipping],
)
def test_flowers_dp_wrappers_are_refused_with_the_reason(wrapper):
    grid = StandInGrid({100: 0, 101: 1, 102: 2})
    wrapped = wrapper(strategy(), noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=3)
    with pytest.raises(FedsubError, match=rf"{wrapper.__name__}.*row deltas.*noise"):
        wrapped.start(grid, ArrayRecord({"w": torch.zeros(5, 1)}), num_rounds=1, timeout=1.0)
    assert not any(
        m.metadata.message_type == MessageType.TRAIN for sent in grid.sent for m in sent
    )  # refused before any node trained
