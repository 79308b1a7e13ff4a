"""What one SuperNode holds: its training samples, its held-out samples, its rows S(k), read as
its node config says: its own file with the run's feature spec, or a partition of the config's
dataset. The node-config keys: docs/tutorials/flower.md, "Run-config keys".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from fedsub.config import Config
from fedsub.data.feature_spec import FeatureSpec, NodeFiles, check_same_spec, read_spec
from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.engine.schedule import Schedule
from fedsub.errors import ConfigError, FedsubError
from fedsub.flower.run_model import federation, spec_model
from fedsub.flower.settings import FlowerSettings
from fedsub.keys import key_names, parse_spelled, spelled
from fedsub.models.base import Model
from fedsub.runs.run_setup import schedule_of
from fedsub.submodel.index import SubmodelIndex

NodeConfigItems = tuple[tuple[str, object], ...]  # a node config's items, sorted (hashable)


@dataclass(frozen=True)
class NodeConfig:
    """The keys of a node config this module reads (spelled with ``-``; others are left to
    their readers), checked by fedsub/keys.py."""

    partition_id: int = field(metadata={"min": 0})
    num_partitions: int = field(default=0, metadata={"min": 0})  # 0: the dataset's clients
    data_file: str = ""
    feature_spec: str = ""
    eval_file: str = ""
    eval_fraction: float = 0.0
    eval_seed: int = 0


@dataclass(frozen=True)
class NodeData:
    client: int
    config: Config  # the run's fedsub config, as this node reads it
    model: Model
    table_rows: dict[str, int]  # every table's size (from the spec or the dataset)
    rows: dict[str, np.ndarray]  # S(k) per table: sorted unique global rows
    samples: SampleSet  # training samples, ids local to S(k)
    train: SampleSet  # the same samples, global ids
    held_out: SampleSet  # global ids
    field_tables: dict[str, str]
    spec: FeatureSpec | None
    # the run's schedule as this node's config gives it: derived, so never out of step with it
    schedule: Schedule = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", schedule_of(self.config))

    def table_of(self, field: str) -> str:
        return self.field_tables.get(field, field)

    def eval_rows(self) -> dict[str, np.ndarray]:
        """Per table the rows an evaluation of this node's training and held-out samples
        reads: S(k) and the held-out samples' rows."""
        rows = {}
        for table, own in self.rows.items():
            fields = [f for f in self.held_out.ids if self.table_of(f) == table]
            extra = [self.held_out.ids[f].values for f in fields]
            rows[table] = np.unique(np.concatenate([own, *extra])).astype(np.int64)
        return rows

    def check_spec(self, run_version: int, run_hash: str) -> None:
        """Refuse to serve a run whose spec is not this node's (or that has none)."""
        who = f"node partition-id={self.client}"
        if self.spec is None and run_hash:
            raise ConfigError(
                f"{who}: the run uses a feature spec (version {run_version}, hash "
                f"{run_hash[:12]}), but this node has none: start it with --node-config "
                '\'data-file="..." feature-spec="..." partition-id=N\''
            )
        if self.spec is not None and not run_hash:
            raise ConfigError(
                f"{who}: this node holds its own data-file, but the run has no feature-spec "
                "(set feature-spec and num-nodes in the run config)"
            )
        if self.spec is not None:
            check_same_spec(self.spec, run_version, run_hash, who)


def node_config_items(node_config: dict[str, object]) -> NodeConfigItems:
    return tuple(sorted(node_config.items()))


@lru_cache(maxsize=64)  # the simulation runtime runs every node in one process
def node_data(settings: FlowerSettings, node_config: NodeConfigItems) -> NodeData:
    """This node's data, loaded once per process; its samples as a one-client dataset, for
    its S(k) and local ids."""
    known = {spelled(name) for name in key_names(NodeConfig)}
    given = parse_spelled(NodeConfig, "node config", {k: v for k, v in node_config if k in known})
    read = _own_files if given.data_file else _partition
    config, model, local, spec = read(settings, given, given.partition_id)
    index = SubmodelIndex.build(local)
    return NodeData(
        given.partition_id,
        config,
        model,
        dict(local.table_rows),
        {t: index.client_rows(t, 0) for t in local.table_rows},
        index.client_samples(local, 0),
        local.train,
        local.test,
        dict(local.field_tables),
        spec,
    )


# what a reader returns: the config, the model, the node's samples as a one-client dataset, its spec
Read = tuple[Config, Model, FederatedDataset, FeatureSpec | None]


def _own_files(settings: FlowerSettings, given: NodeConfig, client: int) -> Read:
    if not settings.deployment.feature_spec:
        raise ConfigError(
            f"node config data-file = {given.data_file!r}: the run has no feature-spec to "
            "read it with (set feature-spec and num-nodes in the run config)"
        )
    if not 0 <= client < settings.deployment.num_nodes:
        raise ConfigError(
            f"node config partition-id = {client}; expected 0 to num-nodes - 1 = "
            f"{settings.deployment.num_nodes - 1} (one number per node)"
        )
    if not given.feature_spec:
        raise ConfigError("node config: data-file needs feature-spec (this node's copy of it)")
    spec = read_spec(given.feature_spec)
    files = NodeFiles(
        Path(given.data_file).expanduser(),
        Path(given.eval_file).expanduser() if given.eval_file else None,
        given.eval_fraction,
        given.eval_seed,
    )
    train, held_out = files.read(spec)
    config = settings.fedsub_config()
    local = FederatedDataset.from_clients("node", spec.table_rows, [train], held_out)
    return config, spec_model(config, spec), local, spec


def _partition(settings: FlowerSettings, given: NodeConfig, client: int) -> Read:
    fed = federation(settings)
    n = fed.dataset.num_clients
    expected = given.num_partitions or n
    if expected != n or not 0 <= client < expected:
        raise FedsubError(
            f"node config partition-id={client} num-partitions={expected}, but "
            f"{fed.dataset.name} has {n} clients: start one node per client"
        )
    test = fed.dataset.test
    held_out = test.take(np.arange(client, len(test), n))
    own = fed.dataset.client(client)
    table_rows, field_tables = dict(fed.dataset.table_rows), dict(fed.dataset.field_tables)
    local = FederatedDataset.from_clients("node", table_rows, [own], held_out, field_tables)
    return fed.config, fed.model, local, None
