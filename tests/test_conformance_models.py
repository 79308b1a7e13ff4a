"""Model conformance: what every model in ``fedsub.models.registry.model_names()`` must do, so a
new model is tested by registering it (and giving ``test_resume_matrix.dataset_for`` data of its
shape); users' nn.Modules wrapped by ``fedsub.models.torch_module`` are checked alike
(``tests/torch_modules.py: wrapped_cases``). Each model, on a few samples of that data in float64:

- ``init`` gives finite tensors of the requested dtype, reproducibly, with one table per table
  it reads, of that table's row count; outputs have one row per sample and the loss is finite;
- one gradient step on a batch lowers the loss on it;
- where it claims ``CohortHead``: ``cohort_head`` equals ``vmap`` of the single-client ``head``;
- every registered backend gives the sequential reference's model after a round (also with
  sub-model masking where it is a ``SliceableModel``);
- where it is a ``SliceableModel``: extracting a slice and placing it back round-trips, the
  slice has the shapes ``slicing.kept`` says, and ``at_capacity`` runs on it.

Which optional capabilities each model claims is listed in test_model_capabilities.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import vmap

from fedsub.masking.capacity import Capacities
from fedsub.masking.schemes import Masking, plan
from fedsub.models.base import (
    Batch,
    CohortHead,
    SliceableModel,
    cohort_features,
    forward,
    packed_names,
)
from fedsub.models.width import ChannelSlice, full_slice
from fedsub.submodel.params import Params

from .conftest import assert_one_step_lowers_loss
from .equivalence import algorithm_for, assert_backends_match_reference
from .test_model_capabilities import CHECKED, EXPECTED, built
from .test_resume_matrix import dataset_for

SLICEABLE = [name for name, claims in EXPECTED.items() if SliceableModel in claims]
WITH_COHORT_HEAD = [name for name, claims in EXPECTED.items() if CohortHead in claims]
# one step of this size lowers every registered model's loss at its initial parameters
STEP = 1e-2
# the batched ResNet is slow at any size: one client step, one round
ROUND = {"resnet18": {"local_steps": 1, "batch_size": 2}}


def folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.getbasetemp())


def init(model, seed: int = 0, dtype=torch.float64):
    return model.init(torch.Generator().manual_seed(seed), dtype)


@pytest.mark.parametrize("name", CHECKED)
def test_init_shapes_dtypes_and_outputs(name, tmp_path_factory):
    model, dataset = built(name, folder(tmp_path_factory))
    params = init(model)
    assert set(params.tables) <= set(dataset.table_rows)
    for table, tensor in params.tables.items():
        assert tensor.dim() == 2 and tensor.shape[0] == dataset.table_rows[table], table
    for tensor in params.tensors():
        assert tensor.dtype == torch.float64 and torch.isfinite(tensor).all()
    again, single = init(model), init(model, dtype=torch.float32)
    for key, value in params.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key  # the generator decides
        assert single.state_dict()[key].dtype == torch.float32
        assert single.state_dict()[key].shape == value.shape, key

    batch = Batch.from_samples(dataset.train.slice(0, 5), torch.float64)
    with torch.no_grad():
        outputs = forward(model, params, batch)
        loss = model.loss(outputs, batch.labels)
    assert outputs.shape[0] == 5
    if model.task == "multiclass":
        assert outputs.dim() == 2 and outputs.shape[1] > 1
    assert loss.dim() == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("name", CHECKED)
def test_one_step_lowers_the_loss(name, tmp_path_factory):
    model, dataset = built(name, folder(tmp_path_factory))
    batch = Batch.from_samples(dataset.train.slice(0, 6), torch.float64)
    assert_one_step_lowers_loss(model, init(model), batch, lr=STEP)


@pytest.mark.parametrize("name", WITH_COHORT_HEAD)
def test_a_cohort_head_equals_the_vmapped_single_client_head(name, tmp_path_factory):
    model, dataset = built(name, folder(tmp_path_factory))
    k, b = 3, 2
    params = init(model)
    batch = Batch.from_samples(dataset.train.slice(0, k * b), torch.float64)
    with torch.no_grad():
        embedded = model.embed(params.tables, batch.ids)
    features = cohort_features(embedded, k, packed_names(model))
    generator = torch.Generator().manual_seed(1)
    dense = {  # a different dense model per client
        n: p + 0.1 * torch.randn(k, *p.shape, generator=generator, dtype=p.dtype)
        for n, p in params.dense.items()
    }
    inputs = None if batch.dense is None else batch.dense.reshape(k, b, -1)
    if packed_names(model):  # packed rows have no client axis to vmap: client by client
        clients = [
            Batch.from_samples(dataset.train.slice(j * b, (j + 1) * b), torch.float64)
            for j in range(k)
        ]
        with torch.no_grad():
            expected = torch.stack(
                [
                    forward(model, Params(params.tables, {n: p[j] for n, p in dense.items()}), c)
                    for j, c in enumerate(clients)
                ]
            )
    else:
        expected = vmap(model.head, in_dims=(0, 0, None if inputs is None else 0))(
            dense, features, inputs
        )
    got = model.cohort_head(dense, features, inputs)
    assert got.shape[:2] == (k, b)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def one_round(name: str, masking: Masking | None = None):
    from fedsub.engine.execution import Execution
    from fedsub.engine.schedule import ClientStep, LocalWork, Schedule

    settings = {"local_steps": 2, "batch_size": 3, **ROUND.get(name, {})}
    return Schedule(
        1,
        3,
        LocalWork(**settings, client_step=ClientStep(lr=0.1)),
        seed=4,
        execution=Execution(dtype=torch.float64),
        settings=() if masking is None else (masking,),
    )


@pytest.mark.parametrize("name", CHECKED)
def test_every_backend_gives_the_reference_model_after_a_round(name, tmp_path_factory):
    model, dataset = built(name, folder(tmp_path_factory))
    _, index = dataset_for(name, folder(tmp_path_factory))
    algorithm = algorithm_for("scaffold", dataset, index, 3)  # the most stages of any round
    assert_backends_match_reference(model, algorithm, dataset, index, one_round(name))


@pytest.mark.parametrize("name", SLICEABLE)
def test_every_backend_gives_the_reference_model_after_a_masked_round(name, tmp_path_factory):
    model, dataset = built(name, folder(tmp_path_factory))
    _, index = dataset_for(name, folder(tmp_path_factory))
    masking = Masking("rolling", Capacities((1.0, 0.5), (), "per-round"))
    algorithm = algorithm_for("fedavg", dataset, index, 3)
    assert_backends_match_reference(model, algorithm, dataset, index, one_round(name, masking))


@pytest.mark.parametrize("scheme", ["static", "rolling", "random"])
@pytest.mark.parametrize("name", SLICEABLE)
def test_slicing_round_trips(name, scheme, tmp_path_factory):
    model, dataset = built(name, folder(tmp_path_factory))
    dense = init(model).dense
    slicing = model.slicing
    assert set(slicing.axes) == set(dense)  # every parameter is described
    shapes = {n: p.shape for n, p in dense.items()}
    piece = plan(scheme, slicing, shapes, 0.5, 2, 0, 1)
    assert isinstance(piece, ChannelSlice)
    extracted = piece.extract(dense)
    kept = slicing.kept(0.5)
    for n, p in dense.items():
        axes = zip(slicing.axes[n], p.shape, strict=True)
        expected = [size if group is None else kept[group] for group, size in axes]
        assert list(extracted[n].shape) == expected, n
    assert any(extracted[n].shape != p.shape for n, p in dense.items())

    blank = {n: torch.zeros_like(p) for n, p in dense.items()}
    piece.place(blank, extracted)
    back = piece.extract(blank)
    marks = {n: torch.zeros_like(p) for n, p in dense.items()}
    piece.place(marks, {n: torch.ones_like(v) for n, v in extracted.items()})
    for n, value in extracted.items():
        assert torch.equal(back[n], value), n  # extract(place(x)) == x
        assert int(marks[n].sum()) == value.numel(), n  # each entry lands once, nothing else
    copy = {n: p.clone() for n, p in dense.items()}
    piece.place(copy, extracted)
    assert all(torch.equal(copy[n], p) for n, p in dense.items())  # place(extract(x)) is x
    whole = full_slice(slicing).extract(dense)
    assert all(torch.equal(whole[n], p) for n, p in dense.items())

    batch = Batch.from_samples(dataset.train.slice(0, 4), torch.float64)
    with torch.no_grad():
        full = model.head(dense, {}, batch.dense)
        narrow = model.at_capacity(0.5).head(extracted, {}, batch.dense)
    assert narrow.shape == full.shape and torch.isfinite(narrow).all()
