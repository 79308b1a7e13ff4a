"""Client work on a submodel equals torch.optim.SGD on the full model with the same batches."""

import numpy as np
import pytest
import torch

from fedsub.client.transforms import Prox
from fedsub.client.work import round_chain
from fedsub.engine.local_sgd import local_sgd
from fedsub.engine.shuffle import cohort_schedules
from fedsub.models.base import Batch, forward
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.transfer import pull


@pytest.mark.parametrize(
    "mu, weight_decay, clip_norm",
    [
        (0.0, 0.0, 0.0),
        (0.0, 0.05, 0.0),
        (0.0, 0.0, 0.05),
        (0.5, 0.0, 0.0),
        (0.5, 0.0, 0.05),
        (0.5, 0.05, 0.0),
    ],
    # (not all three at once: in the full-model reference, weight decay moves rows outside
    # S(k), whose prox gradients would then enter the clipping norm)
    ids=["sgd", "weight-decay", "clip", "prox", "prox-clip", "prox-decay"],
)
def test_submodel_steps_equal_full_model_torch_sgd(small_synthetic, mu, weight_decay, clip_norm):
    """Reference: torch.optim.SGD(weight_decay) on the full model, the prox term in the loss,
    torch.nn.utils.clip_grad_norm_ before the step."""
    ds = small_synthetic
    index = SubmodelIndex.build(ds)
    model = SparseLogisticRegression(dict(ds.table_rows))
    generator = torch.Generator().manual_seed(0)
    full = model.init(generator, torch.float64)
    for t in full.tensors():
        t.normal_(generator=generator)
    k = 5
    samples = index.client_samples(ds, k)
    schedule = cohort_schedules(2, 1, torch.tensor([k]), torch.tensor([len(samples)]), 8, 4)[
        0
    ].numpy()

    rows = {t: torch.from_numpy(index.client_rows(t, k)) for t in ds.table_rows}
    chain = round_chain((Prox(mu),), weight_decay, clip_norm)
    local = local_sgd(model, pull(full, rows), samples, schedule, chain, 0.3)

    reference = full.clone()
    tensors = [t.requires_grad_(True) for t in reference.tensors()]
    anchor = [t.detach().clone() for t in tensors]
    optimizer = torch.optim.SGD(tensors, lr=0.3, weight_decay=weight_decay)
    global_samples = ds.client(k)
    for step in schedule:
        batch = Batch.from_samples(global_samples.take(step), torch.float64)
        optimizer.zero_grad()
        loss = model.loss(forward(model, reference, batch), batch.labels)
        loss = loss + mu / 2 * sum(
            (t - a).pow(2).sum() for t, a in zip(tensors, anchor, strict=True)
        )
        loss.backward()
        if clip_norm:
            torch.nn.utils.clip_grad_norm_(tensors, clip_norm)
        optimizer.step()

    for table in ds.table_rows:
        torch.testing.assert_close(
            local.tables[table], reference.tables[table].detach()[rows[table]], rtol=0, atol=1e-12
        )
        others = torch.ones(ds.table_rows[table], dtype=torch.bool)
        others[rows[table]] = False
        if not weight_decay:  # weight decay would shrink the rest of the full model too
            assert torch.equal(reference.tables[table].detach()[others], full.tables[table][others])
    torch.testing.assert_close(local.dense["bias"], reference.dense["bias"].detach())


def test_sparse_lr_forward_with_dense_features_by_hand():
    from fedsub.data.federated import SampleSet
    from fedsub.data.ragged import Ragged

    model = SparseLogisticRegression({"a": 5, "b": 3}, dense_dim=2)
    params = model.init(torch.Generator().manual_seed(0), torch.float64)
    params.tables["a"][:, 0] = torch.arange(5.0, dtype=torch.float64)
    params.tables["b"][:, 0] = torch.tensor([10.0, 20.0, 30.0], dtype=torch.float64)
    params.dense["bias"][0] = 0.5
    params.dense["dense_weight"][:] = torch.tensor([1.0, -2.0], dtype=torch.float64)
    samples = SampleSet(
        {"a": Ragged.from_lists([[1, 4], [], [2]]), "b": Ragged.from_lists([[0], [2, 2], []])},
        np.array([1.0, 0.0, 1.0], dtype=np.float32),
        np.array([[1.0, 1.0], [0.0, 0.5], [2.0, 0.0]], dtype=np.float32),
    )
    logits = forward(model, params, Batch.from_samples(samples, torch.float64))
    expected = [1 + 4 + 10 + 0.5 + (1 - 2), 60 + 0.5 - 1, 2 + 0.5 + 2]
    torch.testing.assert_close(logits, torch.tensor(expected, dtype=torch.float64))
