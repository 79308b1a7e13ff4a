"""The backend registry: the ways a round's client work can be executed.

A backend runs one round's client work for a whole cohort and returns the members' updates::

    run_cohort(job: CohortJob) -> CohortUpdate      (engine/cohort_job.py)

Every backend must give the sequential reference's updates for the same inputs (every random
stream is keyed by seed, round and client, never by execution order); tests/test_backends.py
(the backend conformance suite) checks each registered backend against it on several models
and algorithms. Adding a backend is one ``register`` call below: ``execution.backend`` accepts it,
the loop runs it and the conformance suite tests it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fedsub.engine import batched, sequential
from fedsub.engine.cohort_job import RunCohort
from fedsub.models.base import Model, is_batchable

LOG = logging.getLogger("fedsub")
REFERENCE = "sequential"  # the plainest correct backend; every other one is tested against it


@dataclass(frozen=True)
class Backend:
    name: str
    run_cohort: RunCohort
    needs_batchable: bool  # runs the cohort as one program: needs ``is_batchable(model)``
    summary: str


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    if backend.name in _REGISTRY:
        raise ValueError(f"backend {backend.name!r} is registered twice")
    _REGISTRY[backend.name] = backend


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str) -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(backend_names())}")
    return _REGISTRY[name]


def backend_for(name: str, model: Model, who: str) -> Backend:
    """The backend to run ``model`` with: ``name``, or the sequential reference (with a
    warning naming ``who`` and the model) when ``name`` batches clients and the model declares
    it cannot be batched."""
    backend = get_backend(name)
    if backend.needs_batchable and not is_batchable(model):
        LOG.warning(
            "%s: model %s cannot be batched; running the %s backend",
            who,
            type(model).__name__,
            REFERENCE,
        )
        return get_backend(REFERENCE)
    return backend


register(
    Backend("sequential", sequential.run_cohort, False, "clients one after another (the reference)")
)
register(Backend("batched", batched.run_cohort, True, "the whole cohort as one program"))
