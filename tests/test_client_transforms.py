"""Client transforms (fedsub.client.transforms): client Adam against torch.optim.Adam, the same
chain on the sequential and batched backends, the chain's order, description and errors."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.client.transforms import (
    Adam,
    Chain,
    Clip,
    Momentum,
    Prox,
    ScaffoldCorrection,
    Sgd,
    WeightDecay,
)
from fedsub.client.work import round_chain
from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.local_sgd import local_sgd
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.models.mlp import MLP
from fedsub.submodel.index import SubmodelIndex

from .conftest import dense_model_by_torch_optim


def dense_client(n: int = 30, dim: int = 6, seed: int = 0) -> SampleSet:
    rng = np.random.default_rng(seed)
    labels = rng.integers(3, size=n)
    x = rng.normal(size=(n, dim)) + labels[:, None]
    return SampleSet({}, labels.astype(np.float32), x.astype(np.float32))


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_client_adam_matches_torch_optim_adam(weight_decay):
    """Reference: torch.optim.Adam (with its weight_decay) on the same batches, one client."""
    model = MLP(inputs=6, classes=3, hidden=(5,))
    params = model.init(torch.Generator().manual_seed(1), torch.float64)
    samples = dense_client()
    order = np.random.default_rng(0).integers(len(samples), size=(7, 4))
    adam = Adam(client_beta1=0.8, client_beta2=0.95, client_eps=1e-6)
    chain = round_chain((adam,), weight_decay=weight_decay)
    ours = local_sgd(model, params.clone(), samples, order, chain, 0.05)

    reference = dense_model_by_torch_optim(
        model,
        params,
        samples,
        order,
        lambda p: torch.optim.Adam(
            p, lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay
        ),
    )
    for n, p in reference.items():
        assert not torch.allclose(p, params.dense[n])  # it trained
        torch.testing.assert_close(ours.dense[n], p, rtol=0, atol=1e-12)


def sparse_dataset(seed: int = 0) -> FederatedDataset:
    from fedsub.data.synthetic_sparse import SyntheticSparseOptions, generate

    return generate(
        SyntheticSparseOptions(num_users=20, num_items=25, mean_samples_per_user=8), seed=seed
    )


@pytest.mark.parametrize("scheme", ["", "@transformed-scheme2"])
def test_client_adam_batched_equals_sequential(scheme):
    """Moments per member in the cohort layout: the batched backend gives the sequential
    reference's model (per-member learning rates under transformed Scheme II)."""
    dataset = sparse_dataset()
    index = SubmodelIndex.build(dataset)
    model = EmbeddingLogisticRegression(dict(dataset.table_rows), embedding_dim=3, init_std=0.3)
    algorithm = build_algorithm(f"fedavg{scheme}", AlgorithmContext(dataset, index, "samples"))
    algorithm = dataclasses.replace(algorithm, client=(Adam(),))
    results = {}
    for backend in ("sequential", "batched"):
        step = ClientStep(lr=0.05, clip_norm=0.5, weight_decay=0.01)
        execution = Execution(dtype=torch.float64, backend=backend)
        schedule = Schedule(3, 6, LocalWork(4, 3, step), seed=2, execution=execution)
        results[backend] = train(model, algorithm, dataset, index, schedule)
    plain = train(
        model,
        build_algorithm(f"fedavg{scheme}", AlgorithmContext(dataset, index, "samples")),
        dataset,
        index,
        Schedule(
            3,
            6,
            local=LocalWork(4, 3, ClientStep(lr=0.05)),
            seed=2,
            execution=Execution(dtype=torch.float64),
        ),
    )
    for name, reference in results["sequential"].state_dict().items():
        got = results["batched"].state_dict()[name]
        torch.testing.assert_close(got, reference, rtol=0, atol=1e-10)
        assert not torch.allclose(reference, plain.state_dict()[name])  # Adam is not SGD


def test_round_chain_puts_pieces_in_the_order_of_operations():
    chain = round_chain(
        (ScaffoldCorrection(), Prox(0.1)), weight_decay=0.1, clip_norm=2.0, momentum=0.5
    )
    assert [t.name for t in chain.transforms] == [
        "prox", "clip", "weight-decay", "scaffold", "momentum", "sgd",
    ]  # fmt: skip
    assert chain.transforms[1] == Clip(2.0) and chain.transforms[2] == WeightDecay(0.1)
    assert chain.transforms[4] == Momentum(0.5) and chain.needs_corrections
    assert [t.name for t in round_chain(()).transforms] == ["sgd"]
    assert [t.name for t in round_chain((Adam(),), clip_norm=1.0).transforms] == ["clip", "adam"]


@pytest.mark.parametrize(
    "pieces, momentum, message",
    [
        ((Adam(),), 0.9, "client piece 'adam' makes its own steps"),
        ((Adam(), Sgd()), 0.0, "'adam', 'sgd' are both a step rule"),
        ((Prox(0.1), Prox(0.2)), 0.0, "client piece 'prox' is named twice"),
    ],
)
def test_round_chain_refuses_pieces_that_do_not_combine(pieces, momentum, message):
    with pytest.raises(ValueError, match=message):
        round_chain(pieces, momentum=momentum)


def test_chain_description_rebuilds_the_same_chain():
    """How the Flower strategy sends a chain to a ClientApp: names and options as JSON."""
    chain = round_chain((Prox(0.3), Adam(client_beta1=0.5)), weight_decay=0.1, clip_norm=1.5)
    text = json.dumps(chain.describe())
    assert Chain.from_description(json.loads(text)) == chain
    with pytest.raises(ValueError, match="unknown client transform 'nesterov'"):
        Chain.from_description([{"name": "nesterov"}])


def test_cohort_layout_reduces_and_spreads_per_member_like_one_client_each():
    """Member j's norm in the cohort layout is its own tensors' norm (OneClient); a per-member
    value lands on exactly member j's rows and on slot j of a stacked dense tensor."""
    from fedsub.client.layout import CohortLayout, OneClient

    generator = torch.Generator().manual_seed(0)
    owner = torch.tensor([0, 0, 1, 2, 2, 2])
    rows, dense = torch.randn(6, 2, generator=generator), torch.randn(3, 4, generator=generator)
    cube = torch.randn(3, 2, 5, generator=generator)  # a dense tensor of another dim
    layout = CohortLayout((owner, None, None), 3)
    norms = layout.squared_norms([rows, dense, cube])
    for j in range(3):
        alone = OneClient().squared_norms([rows[owner == j], dense[j], cube[j]])
        torch.testing.assert_close(norms[j], alone, rtol=1e-6, atol=0)  # float32 sums
    lr_rows, lr_dense, lr_cube = layout.per_tensor(np.array([0.1, 0.2, 0.3]), [rows, dense, cube])
    assert torch.equal(
        (lr_rows * torch.ones_like(rows))[:, 0], torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3, 0.3])
    )
    assert torch.equal((lr_dense * torch.ones_like(dense))[:, 0], torch.tensor([0.1, 0.2, 0.3]))
    assert torch.equal((lr_cube * torch.ones_like(cube))[:, 1, 4], torch.tensor([0.1, 0.2, 0.3]))
    assert OneClient().per_tensor(np.array([0.25]), [rows, dense]) == [0.25, 0.25]
    assert layout.spread_all(0.5, [rows, dense, cube]) == [0.5, 0.5, 0.5]  # a float as it is


def test_clip_scales_each_member_by_the_formula_written_out():
    """g_k * min(1, c / (||g_k|| + 1e-6)), ||g_k|| over member k's rows and its slot of every
    dense tensor: one member under the bound (unchanged), two over it; and for one client."""
    from fedsub.client.layout import CohortLayout, OneClient
    from fedsub.client.transforms import Members

    generator = torch.Generator().manual_seed(3)
    owner = torch.tensor([0, 1, 1, 2])
    rows = torch.randn(4, 2, generator=generator, dtype=torch.float64)
    dense = torch.randn(3, 2, 2, generator=generator, dtype=torch.float64)
    rows[0], dense[0] = rows[0] * 1e-3, dense[0] * 1e-3  # member 0: norm far below the bound
    clip = 0.7
    layout = CohortLayout((owner, None), 3)
    clipped, _ = Clip(clip).update([rows, dense], {}, [rows, dense], Members(layout, np.ones(3)))
    for k in range(3):
        norm = float((rows[owner == k] ** 2).sum() + (dense[k] ** 2).sum()) ** 0.5
        factor = min(1.0, clip / (norm + 1e-6))
        assert (factor == 1.0) == (k == 0)
        torch.testing.assert_close(
            clipped[0][owner == k], rows[owner == k] * factor, rtol=1e-14, atol=0
        )
        torch.testing.assert_close(clipped[1][k], dense[k] * factor, rtol=1e-14, atol=0)
    one, _ = Clip(clip).update([dense[1]], {}, [dense[1]], Members(OneClient(), np.ones(1)))
    norm = float((dense[1] ** 2).sum()) ** 0.5
    torch.testing.assert_close(one[0], dense[1] * (clip / (norm + 1e-6)), rtol=1e-14, atol=0)


STEP_CHAINS = {
    "sgd (its rates spread once per round)": (Sgd(),),
    "clip, sgd": (Clip(0.5), Sgd()),
    "clip, adam (a scaling before a rule that is not one)": (Clip(0.5), Adam()),
    "two clips (the second reads the first's values)": (Clip(0.5), Clip(0.2), Sgd()),
    "prox, clip, sgd": (Prox(0.3), Clip(0.5), Sgd()),
    "clip, momentum, sgd": (Clip(0.5), Momentum(0.9), Sgd()),
    "sgd, clip (the clip reads the scaled values)": (Sgd(), Clip(0.01)),
    "adam": (Adam(),),
}


@pytest.mark.parametrize("cohort", [True, False], ids=["cohort", "one client"])
@pytest.mark.parametrize("name", sorted(STEP_CHAINS))
def test_a_step_in_place_equals_update_then_apply(name, cohort):
    """Chain.step (trailing scalings folded into one multiply-add) against update +
    apply_updates, over two steps (state carried), on a cohort's layout and one client's."""
    from fedsub.client.layout import CohortLayout, OneClient
    from fedsub.client.transforms import Members, apply_updates

    chain = Chain(STEP_CHAINS[name])
    generator = torch.Generator().manual_seed(2)
    if cohort:
        owner = torch.tensor([0, 0, 1, 2, 2])
        # rows of a table, and dense tensors of two dims (the factor spread once per dim)
        layout, lr = CohortLayout((owner, None, None, None), 3), np.array([0.1, 0.2, 0.3])
        shapes = [(5, 2), (3, 4, 2), (3, 4), (3, 2, 2)]
    else:
        layout, lr, shapes = OneClient(), np.array([0.2]), [(5, 2), (4, 2)]
    start = [torch.randn(*s, generator=generator, dtype=torch.float64) for s in shapes]
    members = Members(layout, lr)
    stepped, updated = [x.clone() for x in start], [x.clone() for x in start]
    state_a, state_b = chain.init(stepped, members), chain.init(updated, members)
    for _ in range(2):
        grads = [torch.randn(*s, generator=generator, dtype=torch.float64) for s in shapes]
        state_a = chain.step(grads, state_a, stepped, members)
        updates, state_b = chain.update(grads, state_b, updated, members)
        apply_updates(updated, updates)
    for a, b, x in zip(stepped, updated, start, strict=True):
        assert not torch.equal(a, x)
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
