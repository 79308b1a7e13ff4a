"""[dp]'s central mechanisms are a registry (dp/mechanisms.py): a new mechanism is its module,
its entry and its test, and a run names it in dp.mechanism. Shown with a toy mechanism that
wraps the Gaussian one and records the rounds it combined: the run trains with it (bit for bit
the Gaussian run, seeded), its stage is checkpointed by name, and an unknown name is refused
naming the choices."""

from __future__ import annotations

import re

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
    sampled_accounting,
)
from fedsub.dp.settings import DpSettings
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


def config_of(mechanism: str, *extra: str) -> Config:
    return Config.from_toml(
        None,
        [*SMALL, f"dp.mechanism='{mechanism}'", *SEEDED, "train.algorithms=['fedavg']", *extra],
    )


def setup_of(mechanism: str, *extra: str):
    config = config_of(mechanism, *extra)
    setup = prepare(config)
    return setup, build_algorithm("fedavg", setup.context)


def test_a_registered_mechanism_trains_the_run_that_names_it(recorded):
    setup, algorithm = setup_of("recorded")
    dp = setup.schedule.setting(DpSettings)
    assert dp is not None and dp.mechanism == "recorded"
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


@pytest.fixture
def patterned():
    """A toy mechanism (the Gaussian one) whose spec alone says how it is accounted for (the
    sampled Gaussian's accounting, recording what it was asked), what it refuses (over 100
    rounds) and which optional [dp] key it reads (dp.min_separation); yields the accounting's
    calls."""
    asked = []

    def accounting(dp_asked, num_clients: int):
        asked.append((dp_asked, num_clients))
        return sampled_accounting(dp_asked, num_clients)

    def refusals(dp_asked):
        return [(dp_asked.rounds > 100, "it runs at most 100 rounds")]

    spec = MechanismSpec(
        "patterned",
        gaussian,
        summary="a toy",
        accounting=accounting,
        refusals=refusals,
        keys=frozenset({"dp.min_separation"}),
    )
    MECHANISMS.add_built_in("patterned", spec)
    yield asked
    del MECHANISMS._built_in["patterned"]
    MECHANISMS._entries = None


def test_a_mechanisms_spec_carries_its_accounting_refusals_and_keys(patterned):
    """A new mechanism touches only its own files: config.py and runs/run_setup.py name no
    mechanism, they ask its spec."""
    setup, _ = setup_of("patterned", "dp.min_separation=3")
    dp_asked, num_clients = patterned[-1]
    assert dp_asked.participation.min_separation == 3 and num_clients == setup.dataset.num_clients
    assert dp_asked.calibration.noise_multiplier == 0.8
    expected, _ = sampled_accounting(dp_asked, num_clients)
    dp = setup.schedule.setting(DpSettings)
    assert dp is not None and dp.noise_multiplier == expected
    with pytest.raises(ConfigError, match="'patterned' cannot be used here: it runs at most 100"):
        config_of("patterned", "train.rounds=101")
    with pytest.raises(ConfigError, match=r"dp\.max_participations applies to mechanism = 'ftrl"):
        config_of("patterned", "dp.max_participations=2")
    readers = "mechanism = 'ftrl-tree' or 'ftrl-blt' or 'patterned' only"
    with pytest.raises(ConfigError, match=re.escape(f"dp.min_separation applies to {readers}")):
        config_of("gaussian", "dp.min_separation=3")
