"""Sub-model training (seed 003): width slicing, masking schemes, capacities, slice averaging."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedsub.algorithms.aggregation import client_weights
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.client.work import round_chain
from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.engine.local_sgd import local_sgd
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.masking.aggregate import MaskedCohortUpdate, SliceGroup, aggregate_slices
from fedsub.masking.capacity import Capacities
from fedsub.masking.schemes import Masking, channels, plan, shuffled_piece
from fedsub.models.base import Batch, forward
from fedsub.models.cnn import SmallCNN
from fedsub.models.mlp import MLP
from fedsub.models.resnet import PreActResNet18
from fedsub.models.width import ChannelSlice, check_slicing, full_slice
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import CohortUpdate
from tests.conftest import assert_one_step_lowers_loss, dense_model_by_torch_optim

MODELS = {
    "mlp": MLP(inputs=16, classes=3, hidden=(12, 8)),
    "cnn": SmallCNN(classes=3, side=16, channels=(6, 8)),
    "resnet18": PreActResNet18(classes=3, side=8, in_channels=1, widths=(8, 8, 16, 16)),
}


def init(model, dtype=torch.float64) -> Params:
    return model.init(torch.Generator().manual_seed(0), dtype)


def dense_dataset(clients: int = 6, per_client: int = 20, dim: int = 16, seed: int = 0):
    """Clients with dense features and 3 classes that a small model can learn."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(3, dim)) * 2

    def samples(n: int) -> SampleSet:
        labels = rng.integers(3, size=n)
        x = (centers[labels] + rng.normal(size=(n, dim))).astype(np.float32)
        return SampleSet({}, labels.astype(np.float32), x)

    parts = [samples(per_client + 3 * k) for k in range(clients)]
    return FederatedDataset.from_clients("dense", {}, parts, samples(60))


@pytest.mark.parametrize("name", list(MODELS))
def test_slicing_describes_every_parameter_and_full_extract_then_merge_is_the_identity(name):
    model = MODELS[name]
    params = init(model)
    check_slicing(model.slicing, params.dense)
    whole = full_slice(model.slicing)
    extracted = whole.extract(params.dense)
    merged = {n: torch.full_like(p, math.nan) for n, p in params.dense.items()}
    whole.place(merged, extracted)
    for n, p in params.dense.items():
        assert torch.equal(extracted[n], p) and torch.equal(merged[n], p)  # bit for bit


def _zero_dropped(params: Params, piece: ChannelSlice) -> dict[str, torch.Tensor]:
    """The full model with every entry touching a dropped channel set to zero."""
    out = {}
    for name, p in params.dense.items():
        keep = torch.ones_like(p, dtype=torch.bool)
        for axis, group in enumerate(piece.slicing.axes[name]):
            if group is None:
                continue
            kept = torch.zeros(p.shape[axis], dtype=torch.bool)
            kept[piece.channels[group]] = True
            shape = [1] * p.dim()
            shape[axis] = -1
            keep &= kept.reshape(shape)
        out[name] = torch.where(keep, p, 0.0)
    return out


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("scheme", ["static", "rolling", "random"])
def test_a_sub_models_forward_is_the_full_forward_with_dropped_channels_zeroed(name, scheme):
    from dataclasses import replace

    model = replace(MODELS[name], scaler=False)
    params = init(model)
    shapes = {n: p.shape for n, p in params.dense.items()}
    piece = plan(scheme, model.slicing, shapes, 0.5, 3, 0, 7)
    assert isinstance(piece, ChannelSlice)
    x = torch.rand(5, 16 if name == "mlp" else 256, dtype=torch.float64)
    sub = model.at_capacity(0.5).head(piece.extract(params.dense), {}, x)
    zeroed = model.head(_zero_dropped(params, piece), {}, x)
    torch.testing.assert_close(sub, zeroed, rtol=0, atol=1e-12)


def test_the_scaler_divides_hidden_activations_by_the_capacity():
    model = MLP(inputs=4, classes=2, hidden=(3,))
    params = init(model)
    x = torch.rand(2, 4, dtype=torch.float64)
    d = params.dense
    hidden = torch.relu((x @ d["layer0.weight"].T + d["layer0.bias"]) / 0.5)
    expected = hidden @ d["out.weight"].T + d["out.bias"]
    torch.testing.assert_close(model.at_capacity(0.5).head(d, {}, x), expected)


def test_channel_counts_follow_ceil_of_capacity_times_width():
    kept = PreActResNet18().slicing.kept(1 / 16)
    assert kept["stage0"] == 4 and kept["stage3"] == 32
    assert MLP(inputs=3, hidden=(10,)).slicing.kept(0.25) == {"hidden0": 3}  # ceil(2.5)


@pytest.mark.parametrize("count,kept", [(8, 2), (10, 3), (7, 7), (16, 1)])
def test_rolling_covers_every_channel_within_c_rounds(count, kept):
    seen = set()
    for t in range(1, count + 1):
        window = channels("rolling", count, kept, t, 0, 0, 0)
        assert len(window) == kept == len(set(window.tolist()))
        # FedRolex's window: channels t-1, t, ..., t-2+L (mod C) in round t
        assert window.tolist() == sorted((t - 1 + i) % count for i in range(kept))
        seen |= set(window.tolist())
    assert seen == set(range(count))


@pytest.mark.parametrize("count,kept", [(8, 2), (10, 3), (16, 1)])
def test_shuffled_trains_every_piece_once_per_epoch_in_a_fresh_order(count, kept):
    pieces = math.ceil(count / kept)
    orders = []
    for epoch in range(3):
        rounds = range(epoch * pieces + 1, (epoch + 1) * pieces + 1)
        order = [shuffled_piece(5, t, pieces) for t in rounds]
        assert sorted(order) == list(range(pieces))  # each piece exactly once
        orders.append(order)
        covered = set()
        for t, piece in zip(rounds, order, strict=True):
            chosen = channels("shuffled", count, kept, t, 5, 0, 0).tolist()
            # piece j: the L consecutive channels from j * L (the last one wraps around)
            assert chosen == sorted((piece * kept + i) % count for i in range(kept))
            covered |= set(chosen)
        assert covered == set(range(count))
    if pieces > 3:
        assert len({tuple(o) for o in orders}) > 1  # the order changes between epochs


def test_random_slices_differ_between_clients_and_rounds_and_are_reproducible():
    a = channels("random", 32, 8, 1, 0, client=1, group=0)
    assert np.array_equal(a, channels("random", 32, 8, 1, 0, client=1, group=0))
    assert not np.array_equal(a, channels("random", 32, 8, 1, 0, client=2, group=0))
    assert not np.array_equal(a, channels("random", 32, 8, 2, 0, client=1, group=0))
    assert len(set(a.tolist())) == 8


def test_static_slices_are_the_first_channels_and_shared_by_equal_capacities():
    model = MODELS["cnn"]
    shapes = {n: p.shape for n, p in init(model).dense.items()}
    a = plan("static", model.slicing, shapes, 0.5, 4, 0, client=1)
    b = plan("static", model.slicing, shapes, 0.5, 9, 0, client=2)
    assert a.key() == b.key()
    assert a.channels["conv1"].tolist() == [0, 1, 2]


def test_bernoulli_masks_keep_about_p_of_the_coordinates():
    model = MLP(inputs=50, classes=3, hidden=(100, 100))
    shapes = {n: p.shape for n, p in init(model).dense.items()}
    mask = plan("bernoulli", model.slicing, shapes, 0.25, 1, 0, 3)
    kept = sum(int(m.sum()) for m in mask.masks.values())
    total = sum(m.numel() for m in mask.masks.values())
    assert abs(kept / total - 0.25) < 0.01


def test_fixed_capacities_give_the_leftover_clients_to_the_largest_remainders():
    """9 clients over shares 2.3 / 0.9 / 5.8: floors 2, 0, 5, and the 2 left over go to the
    levels with the largest remainders (0.9 and 0.8), not the smallest or the largest share."""
    fixed = Capacities((1.0, 0.5, 0.25), (0.23, 0.09, 0.58), "fixed")
    levels = fixed.fixed_levels(0, 9)
    assert {v: int((levels == v).sum()) for v in (1.0, 0.5, 0.25)} == {1.0: 2, 0.5: 1, 0.25: 6}


def test_fixed_capacities_follow_the_proportions_and_per_round_ones_are_redrawn():
    fixed = Capacities((1.0, 0.5, 0.25), (0.5, 0.25, 0.25), "fixed")
    levels = fixed.fixed_levels(0, 100)
    assert {v: int((levels == v).sum()) for v in (1.0, 0.5, 0.25)} == {1.0: 50, 0.5: 25, 0.25: 25}
    clients = np.arange(100)
    assert np.array_equal(fixed.of(0, 1, clients, 100), fixed.of(0, 7, clients, 100))
    drawn = Capacities((1.0, 0.5), (), "per-round")
    r1, r2 = drawn.of(0, 1, clients, 100), drawn.of(0, 2, clients, 100)
    assert not np.array_equal(r1, r2) and np.array_equal(r1, drawn.of(0, 1, clients, 100))
    assert 30 < int((r1 == 1.0).sum()) < 70


def _update(client: int, weight: float, deltas: dict[str, torch.Tensor]) -> CohortUpdate:
    return CohortUpdate(
        clients=torch.tensor([client]),
        weights=torch.tensor([weight], dtype=torch.float64),
        multiplicity=torch.ones(1, dtype=torch.int64),
        rows={},
        row_owner={},
        table_deltas={},
        dense_deltas={n: d.unsqueeze(0) for n, d in deltas.items()},
    )


@pytest.mark.parametrize("average_over", ["trainers", "all"])
def test_overlapping_slices_average_per_entry_and_untouched_entries_keep_their_value(
    average_over,
):
    model = MLP(inputs=2, classes=2, hidden=(4,))
    params = init(model)
    slicing = model.slicing
    sets = [[0, 1], [1, 2]]  # channel 3 is trained by no one; channel 1 by both
    weights_n = [1.0, 3.0]
    groups, deltas = [], []
    for j, chosen in enumerate(sets):
        piece = ChannelSlice(slicing, {"hidden0": torch.tensor(chosen)}, 0.5)
        sub = piece.extract(params.dense)
        delta = {n: torch.full_like(p, float(j + 1)) for n, p in sub.items()}  # 1s, then 2s
        deltas.append(delta)
        groups.append(SliceGroup([j], piece, _update(j, weights_n[j], delta)))
    update = MaskedCohortUpdate(
        torch.tensor([0, 1]),
        torch.tensor(weights_n, dtype=torch.float64),
        torch.ones(2, dtype=torch.int64),
        groups,
    )
    a = client_weights(update, "samples")  # 1/4, 3/4
    result = aggregate_slices(update, a, params.dense, average_over).dense
    # By hand, hidden unit h's row of layer0.weight: trainers of h and their deltas.
    w = result["layer0.weight"]
    if average_over == "trainers":
        expected_rows = [1.0, (0.25 * 1 + 0.75 * 2) / 1.0, 2.0, 0.0]
    else:
        expected_rows = [0.25 * 1, 0.25 * 1 + 0.75 * 2, 0.75 * 2, 0.0]
    for h, value in enumerate(expected_rows):
        assert torch.allclose(w[h], torch.full_like(w[h], value))
    # The output layer's columns follow the hidden units; its bias is trained by both.
    expected_bias = 0.25 * 1 + 0.75 * 2
    assert torch.allclose(result["out.bias"], torch.full_like(result["out.bias"], expected_bias))
    assert torch.all(result["out.weight"][:, 3] == 0)  # untouched: no change at all


def _group_update(clients: list[int], weights: list[float], deltas: list[dict]) -> CohortUpdate:
    return CohortUpdate(
        clients=torch.tensor(clients),
        weights=torch.tensor(weights, dtype=torch.float64),
        multiplicity=torch.ones(len(clients), dtype=torch.int64),
        rows={},
        row_owner={},
        table_deltas={},
        dense_deltas={n: torch.stack([d[n] for d in deltas]) for n in deltas[0]},
    )


def test_screening_a_masked_round_keeps_exactly_the_kept_members():
    """MaskedCohortUpdate.select (what screening keeps): dropping member 2, which shares a
    slice with member 0, gives the update built from members 0 and 1 alone, and so the same
    average."""
    model = MLP(inputs=2, classes=2, hidden=(4,))
    params = init(model)
    first = ChannelSlice(model.slicing, {"hidden0": torch.tensor([0, 1])}, 0.5)
    second = ChannelSlice(model.slicing, {"hidden0": torch.tensor([1, 2])}, 0.5)
    rng = np.random.default_rng(3)

    def delta(piece):
        return {
            n: torch.from_numpy(rng.normal(size=p.shape))
            for n, p in piece.extract(params.dense).items()
        }

    d0, d1, d2 = delta(first), delta(second), delta(first)
    weights = [2.0, 3.0, 7.0]
    full = MaskedCohortUpdate(
        torch.tensor([10, 11, 12]),
        torch.tensor(weights, dtype=torch.float64),
        torch.ones(3, dtype=torch.int64),
        [
            SliceGroup([0, 2], first, _group_update([10, 12], [2.0, 7.0], [d0, d2])),
            SliceGroup([1], second, _group_update([11], [3.0], [d1])),
        ],
    )
    kept = full.select([0, 1])
    alone = MaskedCohortUpdate(
        torch.tensor([10, 11]),
        torch.tensor(weights[:2], dtype=torch.float64),
        torch.ones(2, dtype=torch.int64),
        [
            SliceGroup([0], first, _group_update([10], [2.0], [d0])),
            SliceGroup([1], second, _group_update([11], [3.0], [d1])),
        ],
    )
    assert torch.equal(kept.clients, alone.clients) and torch.equal(kept.weights, alone.weights)
    for average_over in ("trainers", "all"):
        got = aggregate_slices(kept, client_weights(kept, "samples"), params.dense, average_over)
        want = aggregate_slices(alone, client_weights(alone, "samples"), params.dense, average_over)
        for n, value in want.dense.items():
            torch.testing.assert_close(got.dense[n], value, rtol=0, atol=1e-12)
    # what finish asks first: a NaN in a member of the second group makes the round suspect
    assert not bool(full.nonfinite())
    d1_bad = {n: v.clone() for n, v in d1.items()}
    next(iter(d1_bad.values())).view(-1)[0] = float("nan")
    bad = MaskedCohortUpdate(
        full.clients,
        full.weights,
        full.multiplicity,
        [full.groups[0], SliceGroup([1], second, _group_update([11], [3.0], [d1_bad]))],
    )
    assert bool(bad.nonfinite()) and not bool(bad.select([0, 2]).nonfinite())
    nobody = MaskedCohortUpdate(full.clients[:0], full.weights[:0], full.multiplicity[:0], [])
    assert not bool(nobody.nonfinite())
    assert torch.equal(full.squared_norms()[[0, 1]], kept.squared_norms())


def test_local_momentum_matches_torch_optim_sgd():
    dataset = dense_dataset(clients=1, per_client=30)
    model = MLP(inputs=16, classes=3, hidden=(10,))
    params = init(model)
    samples = dataset.client(0)
    order = np.random.default_rng(0).integers(len(samples), size=(5, 4))
    chain = round_chain((), weight_decay=1e-3, momentum=0.9)
    ours = local_sgd(model, params.clone(), samples, order, chain, 0.1)

    reference = dense_model_by_torch_optim(
        model,
        params,
        samples,
        order,
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
    )
    for n, p in reference.items():
        torch.testing.assert_close(ours.dense[n], p, rtol=0, atol=1e-12)


def _schedule(scheme, backend="sequential", rounds=3, **masking) -> Schedule:
    return Schedule(
        rounds=rounds,
        clients_per_round=4,
        local=LocalWork(3, 5, ClientStep(lr=0.05, momentum=0.5)),
        seed=0,
        execution=Execution(dtype=torch.float64, backend=backend),
        settings=(Masking(scheme, **masking),),
    )


def _train(model, dataset, scheme, backend="sequential", rounds=3, **masking):
    index = SubmodelIndex.build(dataset)
    context = AlgorithmContext(dataset, index, "samples", 4)
    schedule = _schedule(scheme, backend, rounds, **masking)
    return train(model, build_algorithm("fedavg", context), dataset, index, schedule)


@pytest.mark.parametrize("scheme", ["static", "rolling", "shuffled", "random", "bernoulli"])
def test_masked_training_gives_the_same_model_on_both_backends(scheme):
    dataset = dense_dataset()
    model = MLP(inputs=16, classes=3, hidden=(12, 8))
    capacities = Capacities((1.0, 0.5, 0.25), (), "per-round")
    sequential = _train(model, dataset, scheme, "sequential", capacities=capacities)
    batched = _train(model, dataset, scheme, "batched", capacities=capacities)
    for n, p in sequential.dense.items():
        torch.testing.assert_close(batched.dense[n], p, rtol=0, atol=1e-10)


def test_masking_none_and_full_capacity_are_fedavg():
    dataset = dense_dataset()
    model = MLP(inputs=16, classes=3, hidden=(12, 8))
    plain = _train(model, dataset, "none")
    full = _train(model, dataset, "rolling", capacities=Capacities((1.0,)))
    for n, p in plain.dense.items():
        torch.testing.assert_close(full.dense[n], p, rtol=0, atol=1e-12)


def test_channels_no_client_trains_keep_their_values():
    dataset = dense_dataset()
    model = MLP(inputs=16, classes=3, hidden=(16,))
    before = initial_params(model, _schedule("static"))
    after = _train(model, dataset, "static", rounds=2, capacities=Capacities((0.25,)))
    # Static masking at 1/4 trains hidden units 0..3 only: the rest is untouched.
    assert torch.equal(after.dense["layer0.weight"][4:], before.dense["layer0.weight"][4:])
    assert torch.equal(after.dense["out.weight"][:, 4:], before.dense["out.weight"][:, 4:])
    assert not torch.equal(after.dense["layer0.weight"][:4], before.dense["layer0.weight"][:4])


def hand_average(masks, deltas, a, average_over):
    """Seed 003's per-entry average written out in numpy: member j trained the entries where
    ``masks[j]`` is 1 with delta ``deltas[j]`` and weight ``a[j]``."""
    total = sum(a_j * m * d for a_j, m, d in zip(a, masks, deltas, strict=True))
    if average_over == "all":
        return total / sum(a)
    trained = sum(a_j * m for a_j, m in zip(a, masks, strict=True))
    return np.where(trained > 0, total / np.where(trained > 0, trained, 1.0), 0.0)


@pytest.mark.parametrize("weights_sum", [1.0, 2.5])  # scheme2's a_j need not add up to 1
@pytest.mark.parametrize("average_over", ["trainers", "all"])
def test_bernoulli_mask_aggregation_is_the_per_entry_average_by_hand(average_over, weights_sum):
    """Random 0/1 masks (overlapping, some entries trained by no one) and deltas; weights
    that add up to 1 or not ("all" divides by their sum)."""
    from fedsub.models.width import CoordinateMask

    rng = np.random.default_rng(4)
    shapes = {"w": (5, 3), "b": (3,)}
    like = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}
    masks = [{n: rng.random(s) < 0.4 for n, s in shapes.items()} for _ in range(3)]
    deltas = [{n: rng.normal(size=s) for n, s in shapes.items()} for _ in range(3)]
    weights_n = [2.0, 5.0, 1.0]
    groups = []
    for j in range(3):
        mask = CoordinateMask({n: torch.from_numpy(m) for n, m in masks[j].items()}, 0.4)
        masked = {n: torch.from_numpy(d * masks[j][n]) for n, d in deltas[j].items()}
        groups.append(SliceGroup([j], mask, _update(j, weights_n[j], masked)))
    update = MaskedCohortUpdate(
        torch.arange(3), torch.tensor(weights_n, dtype=torch.float64), torch.ones(3), groups
    )
    a = client_weights(update, "samples") * weights_sum
    result = aggregate_slices(update, a, like, average_over).dense
    for n in shapes:
        expected = hand_average(
            [m[n] for m in masks], [d[n] for d in deltas], a.numpy(), average_over
        )
        np.testing.assert_allclose(result[n].numpy(), expected, rtol=0, atol=1e-12)
    nobody = ~(masks[0]["w"] | masks[1]["w"] | masks[2]["w"])
    assert nobody.any() and (result["w"].numpy()[nobody] == 0).all()


def test_bernoulli_clients_change_only_masked_coordinates(monkeypatch):
    """One round of 4 clients at capacity 0.05: every member's delta is zero off its mask,
    the model changes by exactly the per-entry average of the members' masked deltas (by
    hand), and entries outside every mask keep their value bit for bit."""
    from fedsub.engine.features import masking as masking_feature

    seen = []
    real = masking_feature.aggregate_slices

    def recording(update, weights, like, average_over):
        seen.append((update, weights, average_over))
        return real(update, weights, like, average_over)

    monkeypatch.setattr(masking_feature, "aggregate_slices", recording)
    dataset = dense_dataset()
    model = MLP(inputs=16, classes=3, hidden=(12,))
    before = initial_params(model, _schedule("bernoulli"))
    after = _train(model, dataset, "bernoulli", rounds=1, capacities=Capacities((0.05,)))
    (update, weights, average_over), *_ = seen
    a = weights.numpy()
    union_size = 0
    for n, p in before.dense.items():
        masks, deltas = [], []
        for group in update.groups:
            assert len(group.members) == 1  # a Bernoulli mask is one member's
            mask = group.slice.masks[n].numpy().astype(bool)
            delta = group.update.dense_deltas[n][0].numpy()
            assert (delta[~mask] == 0).all()  # nothing off the mask
            masks.append(mask)
            deltas.append(delta)
        ordered = np.argsort([g.members[0] for g in update.groups])
        expected = hand_average(
            [masks[i] for i in ordered], [deltas[i] for i in ordered], a, average_over
        )
        changed = (after.dense[n] - p).numpy()
        np.testing.assert_allclose(changed, expected, rtol=0, atol=1e-12)
        union = np.logical_or.reduce(masks)
        assert torch.equal(after.dense[n][torch.from_numpy(~union)], p[torch.from_numpy(~union)])
        union_size += int(union.sum())
    total = sum(p.numel() for p in before.dense.values())
    assert 0 < union_size <= 0.25 * total  # 4 clients x ~5% of the coordinates at most


def test_resnet18_shapes_and_one_step():
    model = PreActResNet18(classes=10, side=28, in_channels=1)
    params = init(model, torch.float32)
    assert sum(p.numel() for p in params.dense.values()) == 11_171_018
    images = torch.rand(4, 784)
    assert model.head(params.dense, {}, images).shape == (4, 10)
    small = ChannelSlice(
        model.slicing,
        {g: torch.arange(k) for g, k in model.slicing.kept(1 / 16).items()},
        1 / 16,
    )
    sub = Params({}, small.extract(params.dense))
    assert sub.dense["stem.weight"].shape == (4, 1, 3, 3)
    assert sub.dense["fc.weight"].shape == (10, 32)
    batch = Batch(ids={}, labels=torch.arange(4).float(), dense=images)
    assert forward(model.at_capacity(1 / 16), sub, batch).shape == (4, 10)
    assert_one_step_lowers_loss(model.at_capacity(1 / 16), sub, batch, lr=0.05)


MASKED_CONFIG = """
[data]
name = "mnist"
partition = "dirichlet"
num_clients = 8
dirichlet_alpha = 0.5

[model]
name = "cnn"
widths = [8, 16]

[train]
algorithms = ["fedavg"]
rounds = 4
clients_per_round = 4
local_steps = 3
batch_size = 8
lr = 0.05
momentum = 0.9
weight_decay = 1e-3
clip_norm = 1.0
masking = "rolling"

[eval]
every = 2
"""


def test_compare_sweeps_masking_schemes_and_reports_accuracy_and_generalization_gaps(tmp_path):
    import json

    from fedsub.cli import main
    from tests.test_images import write_image_set

    folder = write_image_set(tmp_path / "idx", n_train=160, n_test=40)
    config = tmp_path / "masked.toml"
    config.write_text(MASKED_CONFIG.replace('"mnist"', f'"mnist"\npath = "{folder}"'))
    out = tmp_path / "sweep"
    argv = ["compare", str(config), "--sweep", "masking.scheme=static,rolling,none"]
    assert main([*argv, "--out", str(out), "--quiet"]) == 0
    table = (out / "sweep.md").read_text()
    assert "final gap accuracy (train - test)" in table and "best test accuracy" in table
    assert "| fedavg | static |" in table and "no target set" in table
    assert "| 4+ |" not in table and "| rounds to target |" not in table  # no such column
    assert (out / "curves.png").stat().st_size > 0
    line = json.loads(
        (out / "masking.scheme=rolling" / "fedavg" / "metrics.jsonl").read_text().splitlines()[-1]
    )
    assert line["round"] == 4
    assert line["gap_loss"] == pytest.approx(line["train_loss"] - line["test_loss"])
    assert line["gap_accuracy"] == pytest.approx(line["train_accuracy"] - line["test_accuracy"])


@pytest.mark.parametrize(
    "change,message",
    [
        (("cnn", "sparse-lr"), "needs a width-sliceable model"),
        (('["fedavg"]', '["scaffold"]'), "cannot be combined with algorithm 'scaffold'"),
        (("momentum = 0.9", "capacity_proportions = [1, 2]"), "one proportion per capacity"),
        (('masking = "rolling"', 'masking = "diagonal"'), "masking.scheme = 'diagonal'"),
        (("momentum = 0.9", "capacities = [0.5, 0]"), "masking.capacities = 0"),
    ],
)
def test_bad_masking_configs_say_what_is_wrong(tmp_path, change, message):
    from fedsub import config as config_lib
    from fedsub.errors import ConfigError

    path = tmp_path / "bad.toml"
    old, new = change
    text = MASKED_CONFIG.replace(old, new)
    assert text != MASKED_CONFIG
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        config_lib.load(path)


@pytest.mark.parametrize(
    ("scheme", "paper_rule"),
    [("bernoulli", "all"), ("shuffled", "all"), ("static", "trainers"), ("rolling", "trainers")],
)
def test_each_scheme_aggregates_as_its_paper_by_default(monkeypatch, scheme, paper_rule):
    """With no ``average_over`` chosen, one round moves the model exactly as the scheme's paper
    writes it. Seed 003's Algorithms 1-2: each client's model w_j filled with the old value w
    where it trained nothing, then averaged over ALL the round's clients,
    w' = sum_j a_j (m_j * w_j + (1 - m_j) * w) / sum_j a_j; HeteroFL / FedRolex: each entry
    averaged over the clients that trained it, w' = w + sum_j a_j m_j d_j / sum_j a_j m_j."""
    from fedsub.engine.features import masking as masking_feature

    seen = []
    real = masking_feature.aggregate_slices

    def recording(update, weights, like, average_over):
        seen.append((update, weights))
        return real(update, weights, like, average_over)

    monkeypatch.setattr(masking_feature, "aggregate_slices", recording)
    dataset = dense_dataset()
    model = MLP(inputs=16, classes=3, hidden=(12,))
    capacities = Capacities((0.5, 0.25))
    assert Masking(scheme).aggregation == paper_rule
    before = initial_params(model, _schedule(scheme))
    after = _train(model, dataset, scheme, rounds=1, capacities=capacities)
    (update, weights), *_ = seen
    a = weights.numpy()
    partly = []
    for n, w in before.dense.items():
        old = w.numpy()
        filled, masks, moves = [], [], []
        for group in update.groups:
            for i, j in enumerate(group.members):
                mask = {n: torch.zeros_like(w)}
                group.slice.add_constant(mask, 1.0)
                delta = {n: torch.zeros_like(w)}
                group.slice.add(delta, {n: group.update.dense_deltas[n][i]})
                m, local = mask[n].numpy(), old + delta[n].numpy()  # the client's model w_j
                filled.append((j, m * local + (1 - m) * old))
                masks.append((j, m))
                moves.append((j, m * (local - old)))
        by_member = [dict(x) for x in (filled, masks, moves)]
        order = sorted(by_member[0])
        if paper_rule == "all":
            expected = sum(a[j] * by_member[0][j] for j in order) / a.sum()
        else:
            trained = sum(a[j] * by_member[1][j] for j in order)
            moved = sum(a[j] * by_member[2][j] for j in order)
            expected = old + np.where(trained > 0, moved / np.where(trained > 0, trained, 1), 0)
        np.testing.assert_allclose(after.dense[n].numpy(), expected, rtol=0, atol=1e-12)
        trained = sum(a[j] * by_member[1][j] for j in order)
        partly.append(bool(((trained > 0) & (trained < a.sum())).any()))
    assert any(partly)  # some entries trained by some clients only: the two rules differ


def test_the_written_out_batch_norm_is_torchs_training_batch_norm_also_under_vmap():
    """models/resnet.py's CUDA path: per channel (x - mean) / sqrt(biased var + 1e-5) * w + b."""
    from fedsub.models.resnet import batch_norm_written_out

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 6, 7, 7, generator=generator, dtype=torch.float64) * 3 + 1
    weight = torch.randn(3, 6, generator=generator, dtype=torch.float64)
    bias = torch.randn(3, 6, generator=generator, dtype=torch.float64)
    mean = x.mean(dim=(1, 3, 4), keepdim=True)
    var = ((x - mean) ** 2).mean(dim=(1, 3, 4), keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5) * weight[:, None, :, None, None] + bias[
        :, None, :, None, None
    ]
    got = torch.vmap(batch_norm_written_out)(x, weight, bias)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        batch_norm_written_out(x[0], weight[0], bias[0]),
        F.batch_norm(x[0], None, None, weight[0], bias[0], training=True),
        rtol=0,
        atol=1e-12,
    )
