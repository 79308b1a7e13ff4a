"""What a Flower run's processes know before any node reports: config, model, schedule; sized
from the run's feature spec (a deployment, whose population is ``num-nodes``), or from the
config's dataset (partitions), which the ServerApp then loads only to size the model and count
the clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from fedsub.config import Config
from fedsub.data.feature_spec import FeatureSpec, read_spec
from fedsub.data.federated import FederatedDataset
from fedsub.engine.schedule import Schedule
from fedsub.flower.settings import FlowerSettings
from fedsub.models.base import Model
from fedsub.runs.run_setup import checked_model, load_data, model_of, schedule_of


@dataclass(frozen=True)
class Federation:
    """Partition mode: a run's config, whole dataset, model and schedule, loaded once per
    process (a node keeps one partition of it)."""

    config: Config
    dataset: FederatedDataset
    model: Model
    schedule: Schedule


@lru_cache(maxsize=4)
def federation(settings: FlowerSettings) -> Federation:
    config = settings.fedsub_config()
    dataset = load_data(config)
    schedule = schedule_of(config, dataset.num_clients)  # [dp] resolved, as run_model's
    return Federation(config, dataset, checked_model(config, dataset), schedule)


@dataclass(frozen=True)
class RunModel:
    """The ServerApp's view of a run: no client's samples, only sizes."""

    config: Config
    model: Model
    schedule: Schedule
    num_clients: int
    spec: FeatureSpec | None


@lru_cache(maxsize=4)
def run_spec(path: str) -> FeatureSpec:
    return read_spec(path)


def spec_model(config: Config, spec: FeatureSpec) -> Model:
    """The configured model sized by the spec's tables and numeric columns."""
    return model_of(config, spec.template(2))


def run_model(settings: FlowerSettings) -> RunModel:
    """What the ServerApp knows; its schedule carries ``[dp]`` resolved for the population
    (central DP runs in the round loop at the ServerApp, as in process)."""
    config = settings.fedsub_config()
    settings.check_against(config)
    spec = run_spec(settings.deployment.feature_spec) if settings.deployment.feature_spec else None
    if spec is not None:
        model, clients = spec_model(config, spec), settings.deployment.num_nodes
    else:
        fed = federation(settings)
        model, clients = fed.model, fed.dataset.num_clients
    schedule = schedule_of(config, clients)
    return RunModel(config, model, schedule, clients, spec)
