"""Round 0's model: the seeded draw, the same on every device."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from fedsub.engine.schedule import Schedule
from fedsub.models.base import Model
from fedsub.numerics import seeding
from fedsub.submodel.params import Params


class ModelStart(Protocol):
    """A model file a run starts from (``sharding/model_file.WrittenModel``): it copies its
    values into round 0's model as drawn, in place."""

    def read_into(self, params: Params) -> Params: ...


class ModelFile(ModelStart, Protocol):
    """A model kept in a file instead of memory (``sharding/model_file.WrittenModel``: a warm
    start's, or a row-sharded run's final model, written by its processes together), read
    whole when asked for."""

    @property
    def path(self) -> Path: ...

    def load(self) -> Params: ...


def init_generator(seed: int) -> torch.Generator:
    """The generator the initial model is drawn with (on the CPU)."""
    return torch.Generator().manual_seed(int(seeding.rng(seed, seeding.INIT).integers(2**62)))


def initial_params(model: Model, schedule: Schedule) -> Params:
    """The seeded initial model on ``schedule.execution.device``: drawn on the CPU and copied
    there, so every device starts from the same numbers."""
    execution = schedule.execution
    return model.init(init_generator(schedule.seed), execution.dtype).to(execution.device)
