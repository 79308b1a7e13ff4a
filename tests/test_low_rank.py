"""Low-rank per-client weights (models/low_rank.py) against dense per-client weights.

The reference is the dense form written out: each member's weight W + sum_s X_s^T D_s as a
[K, in, out] tensor, its gradient from autograd, its norm summed entry by entry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsub.client.transforms import Clip, Momentum, Prox, Sgd, chain
from fedsub.client.work import CohortWork
from fedsub.data.amazon import AmazonFilesOptions, load_fedsubavg_files
from fedsub.engine import batched
from fedsub.models.cohort_ops import linear
from fedsub.models.din import DIN
from fedsub.models.low_rank import LowRankGradient, LowRankWeight, worth_it
from fedsub.submodel.index import SubmodelIndex

from .conftest import assert_backends_agree
from .test_amazon_din import write_user_files

K, N, FAN_IN, FAN_OUT = 3, 4, 5, 6


def tensors(seed: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=generator, dtype=torch.float64) for s in shapes]


def test_forward_backward_norm_and_updates_equal_the_dense_weights():
    """Two updates (per-member factors), then a step: outputs, the input's and bias's
    gradients, the weight's gradient (as factors), its per-member squared norm and the
    members' weights all equal the dense computation."""
    base, x, bias, upstream = tensors(
        0, (FAN_IN, FAN_OUT), (K, N, FAN_IN), (K, FAN_OUT), (K, N, FAN_OUT)
    )
    weight = LowRankWeight(base, K, capacity=3 * N)
    dense = base.expand(K, FAN_IN, FAN_OUT).clone()
    for seed in (1, 2):  # two earlier steps' updates, scaled per member
        left, right = tensors(seed, (K, N, FAN_IN), (K, N, FAN_OUT))
        factor = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64).reshape(K, 1, 1)
        weight.addcmul_(LowRankGradient(left, right), factor)
        dense += torch.bmm(left.transpose(1, 2), right) * factor
    torch.testing.assert_close(weight.dense(), dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weight.change(), dense - base, rtol=1e-12, atol=1e-12)

    x_ours, bias_ours = x.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    ours = linear(x_ours, weight, bias_ours)
    grads = torch.autograd.grad((ours * upstream).sum(), (x_ours, bias_ours, weight.probe))
    gradient = weight.take_gradient()

    x_ref, bias_ref = x.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    dense_ref = dense.clone().requires_grad_(True)
    reference = torch.bmm(x_ref, dense_ref) + bias_ref.unsqueeze(1)
    expected = torch.autograd.grad((reference * upstream).sum(), (x_ref, bias_ref, dense_ref))
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[0], expected[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[1], expected[1], rtol=1e-12, atol=1e-12)
    assert not grads[2].any()  # the probe's gradient: zeros
    torch.testing.assert_close(gradient.dense(), expected[2], rtol=1e-12, atol=1e-12)
    squared = (expected[2] ** 2).sum((1, 2))  # entry by entry
    torch.testing.assert_close(gradient.squared_norms(), squared, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="no backward pass"):
        weight.take_gradient()  # taken once


def test_an_update_with_a_float_factor_scales_its_factors():
    """``add_(update, alpha)``: W += alpha * X^T D (the float factor of a one-client rule)."""
    base, left, right = tensors(4, (FAN_IN, FAN_OUT), (K, N, FAN_IN), (K, N, FAN_OUT))
    weight = LowRankWeight(base, K, capacity=2 * N)
    weight.add_(LowRankGradient(left, right), alpha=-0.25)
    weight.add_(LowRankGradient(left, right))
    expected = base + 0.75 * torch.bmm(left.transpose(1, 2), right)
    torch.testing.assert_close(weight.dense(), expected, rtol=1e-12, atol=1e-12)


def test_an_update_past_the_capacity_is_refused():
    (base,) = tensors(0, (FAN_IN, FAN_OUT))
    weight = LowRankWeight(base, K, capacity=N)
    left, right = tensors(1, (K, N, FAN_IN), (K, N, FAN_OUT))
    weight.add_(LowRankGradient(left, right))
    with pytest.raises(ValueError, match="holds 4 factor rows"):
        weight.add_(LowRankGradient(left, right))


def test_worth_it_when_the_factors_are_fewer_numbers_than_the_weight():
    assert worth_it((90, 200), 40)  # DIN's fc0 at I = 10, B = 4: 11,600 < 18,000
    assert not worth_it((80, 2), 40)  # fc2: 3,280 > 160
    assert not worth_it((10, 10), 5)  # 100 = 100: the dense form


@pytest.fixture(scope="module")
def amazon(tmp_path_factory):
    folder = write_user_files(tmp_path_factory.mktemp("a") / "amazon", users=8, lines=12)
    dataset = load_fedsubavg_files(AmazonFilesOptions(), str(folder), 0)
    return dataset, SubmodelIndex.build(dataset)


def din_work(*pieces) -> CohortWork:
    return CohortWork(chain(*pieces), np.full(K, 0.1))


def test_the_engine_keeps_din_output_layers_low_rank_only_under_scaling_rules():
    """fc0 / fc1 are low-rank under clip + sgd; fc2 is too small to gain; FedProx's term and
    momentum are full-rank, so the dense form runs."""
    model = DIN({"user": 5, "item": 9}, embedding_dim=4)
    dense = model.init(torch.Generator().manual_seed(0), torch.float64).dense
    pulled = {n: v.unsqueeze(0).expand(K, *v.shape) for n, v in dense.items()}
    rows = 3 * 4  # 3 steps of 4 samples
    chosen = batched.low_rank_names(model, din_work(Clip(5.0), Sgd()), pulled, rows)
    assert chosen == {"fc0.weight", "fc1.weight"}
    assert batched.low_rank_names(model, din_work(Prox(0.1), Sgd()), pulled, rows) == set()
    assert batched.low_rank_names(model, din_work(Momentum(0.9), Sgd()), pulled, rows) == set()


def test_din_rounds_with_low_rank_weights_equal_the_sequential_reference(amazon, monkeypatch):
    """The batched engine with DIN's output layers low-rank (checked: the engine chose them)
    trains to the sequential reference's model (float64, 1e-10), with and without clipping;
    FedProx runs the dense form and agrees too."""
    dataset, index = amazon
    model = DIN(dict(dataset.table_rows), embedding_dim=4, init_std=0.3)
    chosen, seen = batched.low_rank_names, []

    def spy(*args):
        names = chosen(*args)
        seen.append(names)
        return names

    monkeypatch.setattr(batched, "low_rank_names", spy)
    for clip in (0.0, 0.01):  # 0.01: a bound every gradient exceeds
        assert_backends_agree(
            model, dataset, index, "fedsubavg", 4, local_steps=3, seed=2, clip_norm=clip
        )
    assert seen and all(names == {"fc0.weight", "fc1.weight"} for names in seen)
    seen.clear()
    assert_backends_agree(model, dataset, index, "fedprox", 4, local_steps=3, seed=2)
    assert seen and all(names == set() for names in seen)


def test_a_weight_used_twice_in_a_step_gets_both_gradients():
    base, x1, x2, bias = tensors(3, (FAN_IN, FAN_OUT), (K, N, FAN_IN), (K, 2, FAN_IN), (K, FAN_OUT))
    weight = LowRankWeight(base, K, capacity=2 * N)
    out = linear(x1, weight, bias).sum() + (linear(x2, weight, bias) ** 2).sum()
    torch.autograd.grad(out, weight.probe)
    dense = base.expand(K, FAN_IN, FAN_OUT).clone().requires_grad_(True)
    reference = (torch.bmm(x1, dense) + bias.unsqueeze(1)).sum()
    reference = reference + ((torch.bmm(x2, dense) + bias.unsqueeze(1)) ** 2).sum()
    (expected,) = torch.autograd.grad(reference, dense)
    torch.testing.assert_close(weight.take_gradient().dense(), expected, rtol=1e-12, atol=1e-12)
