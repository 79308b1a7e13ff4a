"""A user's ``nn.Module`` (issue 36): its contract checked once, before training (outputs
against labels and task, dtypes, NaN outputs, unread dense features), ``loss=`` / ``task=``
taken by ``fedsub.train``, and ``nn.EmbeddingBag`` called as torch documents it, with either
offsets convention, giving the sums a hand-written loop gives."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch
from torch import nn

import fedsub
from fedsub.errors import ConfigError
from fedsub.models.base import Batch
from fedsub.models.torch_module import wrap

SMALL = {"rounds": 1, "clients_per_round": 2, "local_steps": 1, "batch_size": 2}
ROWS, DIM = 12, 3
# each client's id lists: ragged, an empty list included (last in client 1, so the bag
# starts' last entry equals the number of values there)
BAGS = [
    [[1, 2], [3], [4, 5, 6], [0]],
    [[7], [8, 9], [2], []],
    [[10], [11, 1], [], [5]],
    [[6, 6], [4], [3, 2, 1], [9]],
]


def ragged_data(labels=(0, 1, 1, 0), dense: bool = False):
    rng = np.random.default_rng(0)
    parts = [
        fedsub.samples(
            list(labels),
            ids={"item": bags},
            dense=rng.normal(size=(len(bags), 2)) if dense else None,
        )
        for bags in BAGS
    ]
    return fedsub.from_clients(parts, test=parts[0], table_rows={"item": ROWS})


class Bag(nn.Module):
    """A PyTorch user's first model: a summing bag called as torch documents it."""

    def __init__(self, include_last_offset: bool = False, outputs: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.item = nn.EmbeddingBag(ROWS, DIM, mode="sum", include_last_offset=include_last_offset)
        self.out = nn.Linear(DIM, outputs)
        self.outputs = outputs

    def forward(self, batch) -> torch.Tensor:
        values, offsets = batch.ids["item"]
        logits = self.out(self.item(values, offsets))
        return logits.squeeze(-1) if self.outputs == 1 else logits


class BagWithCounts(Bag):
    """A default bag whose forward also reads the offsets itself (the bags' sizes): it
    cannot be split at its table, so it runs whole (the sequential path)."""

    def forward(self, batch) -> torch.Tensor:
        values, offsets = batch.ids["item"]
        sizes = (offsets[1:] - offsets[:-1]).to(self.out.weight.dtype)
        return self.out(self.item(values, offsets)).squeeze(-1) + 0.5 * sizes


def by_hand(module: Bag, bags: list[list[int]], counts: bool = False) -> torch.Tensor:
    """Each sample's logit: its rows summed one by one, then the linear layer."""
    weight = module.item.weight.detach().double()
    w, b = module.out.weight.detach().double(), module.out.bias.detach().double()
    logits = []
    for ids in bags:
        pooled = torch.zeros(DIM, dtype=torch.float64)
        for i in ids:
            pooled = pooled + weight[i]
        logit = (w @ pooled + b)[0]
        logits.append(logit + (0.5 * len(ids) if counts else 0.0))
    return torch.stack(logits)


def wrapped_outputs(module: Bag, data) -> torch.Tensor:
    model = wrap(module, data)
    params = model.init(torch.Generator(), torch.float64)
    batch = Batch.from_samples(data.train, torch.float64)
    with torch.no_grad():
        return model.head(params.dense, model.embed(params.tables, batch.ids), batch.dense)


@pytest.mark.parametrize("include_last_offset", [False, True])
def test_an_embedding_bag_of_either_convention_sums_each_samples_rows(include_last_offset):
    data = ragged_data()
    module = Bag(include_last_offset)
    expected = by_hand(module, [bag for client in BAGS for bag in client])
    torch.testing.assert_close(wrapped_outputs(module, data), expected)
    assert module.item._forward_pre_hooks == {}  # the user's module is left as it was


def test_a_default_bag_in_a_forward_that_runs_whole_gets_the_bag_starts():
    data = ragged_data()
    module = BagWithCounts()
    model = wrap(module, data)
    assert model.lookups is None  # it runs whole: the hook, not the stubs, hands the offsets
    expected = by_hand(module, [bag for client in BAGS for bag in client], counts=True)
    torch.testing.assert_close(wrapped_outputs(module, data), expected)


@pytest.mark.parametrize("module", [Bag(False), Bag(True), BagWithCounts()])
def test_both_conventions_train_on_both_backends(module):
    data = ragged_data()
    runs = [
        fedsub.train(module, data, backend=b, dtype="float64", **SMALL)
        for b in ("sequential", "batched")
    ]
    for name, value in runs[0].params.state_dict().items():
        torch.testing.assert_close(runs[1].params.state_dict()[name], value)


def test_a_bag_given_the_other_conventions_offsets_is_told_what_to_change():
    class StartsToLastOffsetBag(Bag):
        def forward(self, batch) -> torch.Tensor:
            values, offsets = batch.ids["item"]
            return self.out(self.item(values, offsets[:-1])).squeeze(-1)

    with pytest.raises(
        ConfigError, match=r"built with include_last_offset=True, which reads n \+ 1"
    ):
        fedsub.train(StartsToLastOffsetBag(include_last_offset=True), ragged_data(), **SMALL)


# --- outputs against labels and task -----------------------------------------------------------


def test_three_columns_on_binary_labels_are_refused_unless_the_task_says_so():
    with pytest.raises(ConfigError, match=r"returns 3 columns per sample, but every training la"):
        fedsub.train(Bag(outputs=3), ragged_data(), **SMALL)
    run = fedsub.train(Bag(outputs=3), ragged_data(), task="multiclass", **SMALL)
    assert run.fedsub_model.task == "multiclass"


def test_class_labels_beyond_the_columns_are_refused():
    with pytest.raises(ConfigError, match=r"labels must be class indices 0..2; .* range over 0..4"):
        fedsub.train(Bag(outputs=3), ragged_data(labels=(0, 4, 1, 2)), **SMALL)


def test_nan_outputs_are_reported_as_nan_outputs():
    class NaNOutputs(Bag):
        def forward(self, batch) -> torch.Tensor:
            return super().forward(batch) * float("nan")

    with pytest.raises(ConfigError, match=r"returned NaN outputs on 8 training samples"):
        fedsub.train(NaNOutputs(), ragged_data(), **SMALL)


def test_a_float64_submodule_is_refused_before_torch_fails_or_trains_in_float64():
    class Float64Head(Bag):
        def __init__(self) -> None:
            super().__init__()
            self.out = self.out.double()

        def forward(self, batch) -> torch.Tensor:
            values, offsets = batch.ids["item"]
            return self.out(self.item(values, offsets).double()).squeeze(-1)

    with pytest.raises(
        ConfigError, match=r"fails when fedsub trains it in float32 .* parameters are float64"
    ):
        fedsub.train(Float64Head(), ragged_data(), **SMALL)
    assert fedsub.train(Float64Head(), ragged_data(), dtype="float64", **SMALL).diverged is None


def test_dense_features_the_module_never_reads_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        fedsub.train(Bag(), ragged_data(dense=True), **SMALL)
    assert "reads no dense features: the dataset's 2 per sample" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        fedsub.train(Bag(), ragged_data(), **SMALL)
    assert "dense" not in caplog.text


def test_loss_and_task_are_taken_by_train_and_compare():
    def squared(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ((torch.sigmoid(outputs) - labels) ** 2).mean()

    data = ragged_data()
    module = Bag()
    run = fedsub.train(module, data, loss=squared, task="binary", train_loss_samples=16, **SMALL)
    probabilities = torch.sigmoid(by_hand(module, [bag for client in BAGS for bag in client]))
    labels = torch.tensor([0, 1, 1, 0] * 4, dtype=torch.float64)
    expected = float(((probabilities - labels) ** 2).mean())
    assert run.history[0]["train_loss"] == pytest.approx(expected, rel=1e-5)
    runs = fedsub.compare(module, data, algorithms=["fedavg"], loss=squared, **SMALL)
    assert runs["fedavg"].history[0]["train_loss"] == pytest.approx(expected, rel=1e-5)
    with pytest.raises(fedsub.ArgumentError, match=r"task must be one of binary, multiclass"):
        fedsub.train(module, data, task="classification", **SMALL)
    with pytest.raises(fedsub.ArgumentError, match=r"loss must be a function"):
        fedsub.train(module, data, loss="mse", **SMALL)


# --- modules fedsub cannot train: gradients, copies, devices, dtypes, state --------------------


class NoGradForward(Bag):
    def forward(self, batch) -> torch.Tensor:
        with torch.no_grad():
            return super().forward(batch)


class DetachedOutputs(Bag):
    def forward(self, batch) -> torch.Tensor:
        return super().forward(batch).detach()


class HoldsALock(Bag):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


class ComplexParameter(Bag):
    def __init__(self) -> None:
        super().__init__()
        self.phase = nn.Parameter(torch.ones(1, dtype=torch.complex64))

    def forward(self, batch) -> torch.Tensor:
        return super().forward(batch) + self.phase.real


class CountsInABuffer(Bag):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, batch) -> torch.Tensor:
        self.seen += 1
        return super().forward(batch)


class WritesATableRow(Bag):
    def forward(self, batch) -> torch.Tensor:
        self.item.weight.data[0] = 0.0
        return super().forward(batch)


class WithBatchNorm(Bag):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(DIM)


def on_meta() -> nn.Module:
    with torch.device("meta"):
        return Bag()


UNTRAINABLE = [
    (NoGradForward, r"module NoGradForward: no gradient flows .* torch.no_grad\(\)"),
    (DetachedOutputs, r"module DetachedOutputs: no gradient flows .*detached its outputs"),
    (HoldsALock, r"module HoldsALock cannot be copied .*attribute 'lock' \(a lock\)"),
    (on_meta, r"parameter 'item.weight' of module Bag is on the meta device"),
    (ComplexParameter, r"parameter 'phase' of module ComplexParameter is torch.complex64"),
    (CountsInABuffer, r"module CountsInABuffer's forward changed its own state \('seen'\)"),
    (WritesATableRow, r"module WritesATableRow's forward changed its own state \('item.weight'"),
    (WithBatchNorm, r"module 'norm' is a BatchNorm1d: its running statistics are buffers"),
]


@pytest.mark.parametrize(("make", "expected"), UNTRAINABLE)
def test_a_module_fedsub_cannot_train_is_refused_naming_it_and_what_to_change(make, expected):
    """Each refused before any round (never a raw torch error, never trained silently), as
    the error class of a bad argument; the buffer policy is one rule: buffers are constants."""
    with pytest.raises(ConfigError, match=expected):
        fedsub.train(make(), ragged_data(), **SMALL)
