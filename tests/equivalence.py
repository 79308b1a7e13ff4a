"""The one way tests run the same training on several backends and compare each with the
sequential reference (engine/backends.py's REFERENCE): used by test_backends.py, the
conformance suites and conftest's ``assert_backends_agree``."""

from __future__ import annotations

import dataclasses

import torch

from fedsub.algorithms.registry import Algorithm, AlgorithmContext, build_algorithm
from fedsub.engine.backends import REFERENCE, backend_names
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.engine.schedule import Schedule
from fedsub.submodel.params import Params

from .conftest import TEST_DEVICE

# every registered backend except the reference: what the equivalence tests check
CHECKED_BACKENDS = [name for name in backend_names() if name != REFERENCE]


def algorithm_for(
    name: str, dataset, index, clients: int = 1, heat: str = "samples", options=None
) -> Algorithm:
    """A registry algorithm (``name`` may carry a ``@scheme``) built for ``dataset``."""
    return build_algorithm(name, AlgorithmContext(dataset, index, heat, clients), options)


def with_execution(schedule: Schedule, **changes) -> Schedule:
    """``schedule`` with some of its [execution] settings changed (``backend="sequential"``)."""
    return dataclasses.replace(
        schedule, execution=dataclasses.replace(schedule.execution, **changes)
    )


def train_on_backends(
    model, algorithm: Algorithm, dataset, index, schedule: Schedule, backends: list[str]
) -> dict[str, Params]:
    """The global model after ``schedule`` on the reference (on the CPU) and on each of
    ``backends`` (on FEDSUB_TEST_DEVICE, the CPU unless set; width-sliced training too)."""
    device = TEST_DEVICE
    # the reference always runs as the reference (a Schedule's default backend is "batched")
    reference = with_execution(schedule, backend=REFERENCE)
    results = {REFERENCE: train(model, algorithm, dataset, index, reference)}
    for backend in backends:
        on_device = with_execution(schedule, backend=backend, device=device)
        trained = train(model, algorithm, dataset, index, on_device)
        results[backend] = trained.to(schedule.execution.device)
    return results


def assert_equal_to_reference(results: dict[str, Params], rtol: float, atol: float) -> None:
    """Every backend's model equals the reference's, tensor by tensor."""
    reference = results[REFERENCE].state_dict()
    for backend, params in results.items():
        got = params.state_dict()
        assert got.keys() == reference.keys(), backend
        for name, expected in reference.items():
            where = f"{backend} {name}"
            torch.testing.assert_close(
                got[name], expected, rtol=rtol, atol=atol, msg=lambda m, w=where: f"{w}: {m}"
            )


def assert_backends_match_reference(
    model,
    algorithm: Algorithm,
    dataset,
    index,
    schedule: Schedule,
    backends: list[str] | None = None,
    rtol: float = 0.0,
    atol: float = 1e-10,
) -> dict[str, Params]:
    """Train on the reference and on ``backends`` (default: every other registered one),
    require that the reference moved from its initial model (so equality says something) and
    that every backend gives its model. Returns the models by backend."""
    results = train_on_backends(
        model,
        algorithm,
        dataset,
        index,
        schedule,
        CHECKED_BACKENDS if backends is None else backends,
    )
    start = initial_params(model, schedule).state_dict()
    trained = results[REFERENCE].state_dict()
    assert any(not torch.equal(trained[n], start[n]) for n in start), "the model did not train"
    assert_equal_to_reference(results, rtol, atol)
    return results
