"""Shared fixtures: tiny federated datasets built by hand or by the embedded generator."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import settings

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged
from fedsub.data.synthetic_sparse import SyntheticSparseOptions, generate
from fedsub.device import resolve_device
from fedsub.submodel.params import Params

# CI runs the same examples every time (a red CI is then a real regression, reproducible
# locally); `HYPOTHESIS_PROFILE=explore pytest` searches fresh random examples on each run.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def listing_cache(tmp_path_factory):
    """`fedsub list`'s cache (cli/listing_cache.py) in a folder of the test session, never
    the user's ~/.cache (subprocesses inherit it)."""
    previous = os.environ.get("FEDSUB_CACHE")
    os.environ["FEDSUB_CACHE"] = str(tmp_path_factory.mktemp("fedsub-cache"))
    yield
    if previous is None:
        os.environ.pop("FEDSUB_CACHE", None)
    else:
        os.environ["FEDSUB_CACHE"] = previous


@pytest.fixture
def flower_task_identity(monkeypatch):
    """Outside a Flower runtime, Messages need the process's task identity (run, task and
    node ids; flwr 1.41 internals), which a Flower runtime sets: modules that build Messages
    in process use it (``pytestmark = pytest.mark.usefixtures("flower_task_identity")``).
    Without Flower installed (an optional extra) the test is skipped."""
    task_identity = pytest.importorskip("flwr.supercore.task_identity")
    TaskIdentity = task_identity.TaskIdentity

    for name in ("_task_id", "_run_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


# The device of the backend-equivalence tests (execution.device's forms): `FEDSUB_TEST_DEVICE=cuda
# pytest tests/test_backends.py` runs them on a GPU; the default is the CPU.
TEST_DEVICE = resolve_device(os.environ.get("FEDSUB_TEST_DEVICE", "cpu"))


def make_dataset(
    clients: list[list[list[int]]], table_rows: int, seed: int = 0, table: str = "t"
) -> FederatedDataset:
    """Clients given as lists of samples, each a list of ids of one table; random labels."""
    rng = np.random.default_rng(seed)
    parts = [
        SampleSet(
            {table: Ragged.from_lists(samples)},
            rng.integers(2, size=len(samples)).astype(np.float32),
        )
        for samples in clients
    ]
    return FederatedDataset.from_clients("hand-made", {table: table_rows}, parts, parts[0])


@pytest.fixture(scope="session")
def small_synthetic() -> FederatedDataset:
    return generate(
        SyntheticSparseOptions(num_users=40, num_items=30, mean_samples_per_user=12), seed=3
    )


@dataclass(frozen=True)
class SquaredDistance:
    """Per sample: sum over its ids m of (w_m - xi)^2, xi being the label; w starts at w0."""

    rows: int
    w0: float
    task: str = "regression"

    def init(self, generator, dtype):
        return Params({"w": torch.full((self.rows, 1), self.w0, dtype=dtype)}, {})

    def embed(self, tables, ids):
        values, offsets = ids["w"]
        w = tables["w"]
        bag = lambda weight: F.embedding_bag(  # noqa: E731
            values, weight, offsets, mode="sum", include_last_offset=True
        )[:, 0]
        return {"moments": torch.stack([bag(w**2), bag(w), bag(torch.ones_like(w))], dim=1)}

    def head(self, dense, features, dense_inputs):
        return features["moments"]

    def loss(self, outputs, labels):
        sq, s, count = outputs.unbind(1)
        return (sq - 2 * labels * s + labels**2 * count).mean()


def assert_one_step_lowers_loss(model, params: Params, batch, lr: float) -> None:
    """One plain gradient step on ``batch`` must lower the model's loss on it."""
    from fedsub.models.base import forward

    tensors = [t.requires_grad_(True) for t in params.tensors()]
    before = model.loss(forward(model, params, batch), batch.labels)
    grads = torch.autograd.grad(before, tensors)
    with torch.no_grad():
        for t, g in zip(tensors, grads, strict=True):
            t -= lr * g
        after = model.loss(forward(model, params, batch), batch.labels)
    assert float(after) < float(before.detach())


def assert_backends_agree(
    model, dataset, index, algorithm: str, clients: int, lr=0.2, clip_norm=0.0, **schedule
):
    """Every backend trains ``algorithm`` to the reference's global model (float64, 1e-10)."""
    from fedsub.engine.execution import Execution
    from fedsub.engine.schedule import ClientStep, LocalWork, Schedule

    from .equivalence import algorithm_for, assert_backends_match_reference

    settings = {"rounds": 3, "local_steps": 2, "batch_size": 4, "seed": 0, **schedule}
    local = {k: settings.pop(k) for k in ("local_steps", "batch_size")}
    run = Schedule(
        clients_per_round=clients,
        local=LocalWork(**local, client_step=ClientStep(lr, clip_norm=clip_norm)),
        execution=Execution(dtype=torch.float64),
        **settings,
    )
    built = algorithm_for(algorithm, dataset, index, clients)
    assert_backends_match_reference(model, built, dataset, index, run)


# A small synthetic-sparse comparison (FedAvg vs FedSubAvg, 4 rounds) for tests that run whole
# comparisons: its [data] and [train]; callers append [train] keys, then their other sections.
TINY_COMPARISON = """
[data]
name = "synthetic-sparse"
num_users = 40
num_items = 30
mean_samples_per_user = 8

[train]
algorithms = ["fedavg", "fedsubavg"]
rounds = 4
clients_per_round = 6
local_steps = 2
batch_size = 4
lr = 0.2
"""


def dense_model_by_torch_optim(model, params, samples, order, make_optimizer) -> dict:
    """The reference for local rules on a model with dense parameters only: a copy of them
    trained by a real torch.optim optimizer (``make_optimizer(parameters)``), one step per
    row of ``order`` (that step's sample indices into ``samples``), in float64."""
    from fedsub.models.base import Batch

    reference = {n: p.clone().requires_grad_(True) for n, p in params.dense.items()}
    optimizer = make_optimizer(reference.values())
    for step in order:
        batch = Batch.from_samples(samples.take(step), torch.float64)
        optimizer.zero_grad()
        model.loss(model.head(reference, {}, batch.dense), batch.labels).backward()
        optimizer.step()
    return {n: p.detach() for n, p in reference.items()}
