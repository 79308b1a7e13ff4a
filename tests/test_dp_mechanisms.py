"""[dp]'s central mechanisms are a registry (dp/mechanisms.py): a new mechanism is its module,
its entry and its test, and a run names it in dp.mechanism. Shown with a toy mechanism that
wraps the Gaussian one and records the rounds it combined: the run trains with it (bit for bit
the Gaussian run, seeded), its stage is checkpointed by name, and an unknown name is refused
naming the choices."""

from __future__ import annotations

import pytest
import torch

from fedsub.algorithms.registry import build_algorithm
from fedsub.config import Config
from fedsub.dp.mechanism import DpMechanism
from fedsub.dp.mechanisms import (
    MECHANISMS,
    CentralMechanism,
    MechanismInputs,
    MechanismSpec,
    gaussian,
)
from fedsub.engine.features.assembly import Assembly, assemble
from fedsub.engine.in_process import train
from fedsub.errors import ConfigError
from fedsub.runs.run_setup import prepare

from .test_dp import SMALL

SEEDED = ["dp.noise_multiplier=0.8", "dp.clip=0.5", "dp.randomness='seeded'"]


class Recorded:
    """The Gaussian mechanism, recording the rounds it combined (a checkpoint stage)."""

    def __init__(self, inputs: MechanismInputs) -> None:
        self.inner: DpMechanism = gaussian(inputs)
        self.rounds: list[int] = []

    def combine(self, update, round_index: int):
        self.rounds.append(round_index)
        return self.inner.combine(update, round_index)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"rounds": torch.tensor(self.rounds, dtype=torch.int64)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.rounds = tensors["rounds"].tolist()


def recorded_stages(mechanism: CentralMechanism) -> dict:
    return {"dp_recorded": mechanism}


@pytest.fixture
def recorded():
    """The toy mechanism registered as "recorded" (as a built-in entry) for one test; yields
    the mechanisms built."""
    built: list[Recorded] = []

    def build(inputs: MechanismInputs) -> Recorded:
        built.append(Recorded(inputs))
        return built[-1]

    MECHANISMS.add_built_in("recorded", MechanismSpec("recorded", build, recorded_stages))
    yield built
    del MECHANISMS._built_in["recorded"]
    MECHANISMS._entries = None


def setup_of(mechanism: str):
    config = Config.from_toml(
        None, [*SMALL, f"dp.mechanism='{mechanism}'", *SEEDED, "train.algorithms=['fedavg']"]
    )
    setup = prepare(config)
    return setup, build_algorithm("fedavg", setup.context)


def test_a_registered_mechanism_trains_the_run_that_names_it(recorded):
    setup, algorithm = setup_of("recorded")
    assert setup.schedule.dp is not None and setup.schedule.dp.mechanism == "recorded"
    run = assemble(setup.model, algorithm, setup.dataset, setup.index, setup.schedule, Assembly())
    assert "dp_recorded" in run.rounds.stages()
    args = (setup.model, algorithm, setup.dataset, setup.index, setup.schedule)
    mine = train(*args)
    gaussian_setup, gaussian_algorithm = setup_of("gaussian")
    theirs = train(
        gaussian_setup.model,
        gaussian_algorithm,
        gaussian_setup.dataset,
        gaussian_setup.index,
        gaussian_setup.schedule,
    )
    for name, value in theirs.state_dict().items():
        assert torch.equal(mine.state_dict()[name], value), name


def test_the_mechanism_combines_every_round(recorded):
    setup, algorithm = setup_of("recorded")
    train(setup.model, algorithm, setup.dataset, setup.index, setup.schedule)
    assert len(recorded) == 1 and recorded[0].rounds == list(range(1, setup.schedule.rounds + 1))


def test_an_unknown_mechanism_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="gaussian"):
        Config.from_toml(None, [*SMALL, "dp.mechanism='laplace'", *SEEDED])
