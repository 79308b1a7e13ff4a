"""Private rounds (``privacy.level``) as a feature: the members' download requests around the
client work (``client_stage``, which runs the backend between them) and the private
aggregation (privacy/private_rounds.py), with [dp]'s streams at "full" (distributed DP: the
clients add the noise). Not with width slices (config.py refuses
private levels with masking), row-sharded tables, or CentralSGD (the pooled reference has no
clients to protect).

The randomized-response heat's secret is the privacy feature's too (``HEAT_SECRET``, a feature
of its own, last in the assembly's order): its one piece is the checkpoint stage
``heat_secret`` (privacy/randomness.py ``HeatCoins``), so that a resumed run reads back the key
its heat was computed from, before it builds the algorithms (runs/experiment.py). Only in secret
mode: a seeded run's coins are train.seed's, nothing to keep. The heat is computed in every
process alike (row-sharded tables: each its rows'), so every process keeps the stage."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from fedsub.algorithms.aggregation import Aggregation, ServerUpdate, aggregate
from fedsub.algorithms.registry import HeatSource, MeasuredHeat
from fedsub.engine.cohort_job import CohortJob, RunCohort
from fedsub.engine.contribution import (
    Combining,
    Feature,
    RoundContribution,
    RoundFeatures,
    RoundSetup,
    handle_of,
    taking,
    watching,
)
from fedsub.engine.features.dp import NAME as DP
from fedsub.engine.features.dp import DpRound, dp_settings, server_noise
from fedsub.engine.features.masking import NAME as MASKING
from fedsub.engine.features.row_sharding import NAME as ROW_SHARDING
from fedsub.engine.features.row_sharding import SETTING as ROW_SHARDING_SETTING
from fedsub.engine.schedule import Schedule
from fedsub.engine.split_cohort import concatenated, run_share
from fedsub.errors import ConfigError, FedsubError
from fedsub.feature_messages import Ask, Carried, Fields
from fedsub.privacy.download_protocol import NodeRequests
from fedsub.privacy.heat_protocol import HeatExchange
from fedsub.privacy.heat_report import HeatReport
from fedsub.privacy.heat_sources import HeatPrivacy
from fedsub.privacy.levels import Privacy, describe
from fedsub.privacy.private_rounds import PrivateRounds, WithoutRows, skipped_rows, unbias
from fedsub.privacy.randomness import HEAT_STAGE, HeatCoins
from fedsub.privacy.randomness import STAGE as PRIVACY_SECRET
from fedsub.privacy.randomness import streams_of as privacy_streams_of
from fedsub.privacy.secure_rows_protocol import SecureRows
from fedsub.submodel.heat import HeatKind
from fedsub.submodel.transfer import CohortUpdate

NAME = "private_rounds"


def contribute(setup: RoundSetup) -> RoundContribution | None:
    schedule, algorithm, params = setup.schedule, setup.algorithm, setup.params
    privacy = schedule.setting(Privacy)
    if privacy is None or algorithm.central or MASKING in setup.earlier or params is None:
        return None
    if ROW_SHARDING in setup.earlier:
        if privacy.level != "none":
            raise ConfigError(f"{ROW_SHARDING_SETTING} cannot be combined with privacy levels")
        return None
    table_rows = {t: int(table.shape[0]) for t, table in params.tables.items()}
    aggregation = algorithm.aggregation.to(schedule.execution.device)
    dp, noisy = setup.earlier.get(DP), None
    if privacy.secure_aggregation and dp_settings(schedule) is not None:
        # [dp] at "full": the clients add the noise (distributed DP, dp/distributed.py); never
        # a secure sum without it when [dp] asks for it
        if not isinstance(dp, DpRound):
            raise FedsubError("[dp] at privacy.level 'full': no [dp] round before the secure sums")
        noisy = dp.distributed(schedule.seed)
    requests = None  # the download requests' coins and decoys (privacy/randomness.py)
    if privacy.private_download:
        requests = privacy_streams_of(privacy.randomness, schedule.seed)
    private = PrivateRounds(
        privacy, aggregation, table_rows, schedule.seed, dp=noisy, requests_key=requests,
    )  # fmt: skip
    return RoundContribution(
        NAME,
        client_stage=lambda run_cohort: client_stage(private, run_cohort),
        # the private aggregation builds the round's combine from the aggregation as the other
        # features adjust it (host tables at level none: the coefficients on the host): no
        # override at any level, so at level none the round combines as without the feature
        # (its costs counted); a central DP mechanism's override, or a runtime's own combine
        # (the clock's FedBuff), replaces it
        combining=Combining(
            combine=lambda aggregation: taking(CohortUpdate, private.combining(aggregation))
        ),
        handle=private,
        # the requests' secret: only checkpoints keep it
        stages={PRIVACY_SECRET: requests} if requests is not None and requests.guaranteed else {},
    )


def client_stage(private: PrivateRounds, run_cohort: RunCohort) -> RunCohort:
    """The backend's ``run_cohort`` between the members' download requests (drawn first) and
    what the server receives of their updates (``PrivateRounds.received``: each member's of
    its requested rows)."""

    def run(job: CohortJob) -> CohortUpdate:
        started = time.perf_counter()
        tables = list(job.index.rows)  # the tables clients hold rows of
        held = {
            int(k): {t: job.index.client_rows(t, int(k)) for t in tables}
            for k in job.cohort.clients
        }
        requests = private.draw_requests(held, job.round)
        private.costs.client_seconds += time.perf_counter() - started
        started = time.perf_counter()
        if private.privacy.keep < 1.0:  # rows skipped: each member trains on its own view
            update = run_members(run_cohort, held, requests, job)
        else:
            update = run_cohort(job)
        private.costs.training_seconds += time.perf_counter() - started
        return private.received(update)

    return run


def run_members(
    run_cohort: RunCohort,
    held: dict[int, dict[str, np.ndarray]],
    requests: dict[int, dict[str, np.ndarray]],
    job: CohortJob,
) -> CohortUpdate:
    """The backend on each member alone, with the held rows its request left out reading
    as zero (``WithoutRows``); the members' updates concatenated in cohort order."""
    parts = []
    tables, dense = job.params.tables, job.params.dense
    device = next(iter(tables.values())).device
    for j, k in enumerate(job.cohort.clients.tolist()):
        skipped = skipped_rows(held[int(k)], requests[int(k)])
        view = WithoutRows(
            tables, dense, {t: torch.from_numpy(r).to(device) for t, r in skipped.items()}
        )
        part = run_share(run_cohort, range(j, j + 1), dataclasses.replace(job, params=view))
        assert part is not None  # one member: never an empty share
        parts.append(part)
    return concatenated(parts)


@dataclass
class PrivateReport:
    """What a run's private rounds report (runs/experiment.py): their costs so far, a round's
    metrics, and privacy.json's record of the level. The rounds come through
    ``RunControl.watch`` (``watch``)."""

    rounds: list[PrivateRounds] = field(default_factory=list)

    def watch(self) -> dict[str, Callable[[object], None]]:
        """``RunControl.watch``'s watcher of this feature's handle."""
        return {NAME: watching(PrivateRounds, self.rounds.append)}

    def costs(self) -> dict | None:
        """The private rounds' costs so far (None: the run has none)."""
        return self.rounds[0].costs.as_json() if self.rounds else None

    def records(self, withheld: str | None = None) -> list[tuple[dict, int, float]]:
        """privacy.json's record of each private rounds' level (its guarantees) and costs
        (``withheld`` says why not, in their place), with how many values secure aggregation
        clipped and to what (privacy.secagg_clip)."""
        return [
            (
                {
                    **p.described(),
                    **(p.costs.as_json() if withheld is None else {"costs": withheld}),
                },
                p.costs.clipped,
                p.privacy.secagg_clip,
            )
            for p in self.rounds
        ]


def private_rounds_of(features: RoundFeatures) -> PrivateRounds | None:
    """The run's ``PrivateRounds``, or None when it has no private level."""
    return handle_of(features, NAME, PrivateRounds)


FEATURE = Feature(NAME, contribute)

HEAT_SECRET_NAME = "heat_secret"


def contribute_heat_secret(setup: RoundSetup) -> RoundContribution | None:
    coins = setup.algorithm.heat_coins
    if not isinstance(coins, HeatCoins) or not coins.guaranteed:
        return None
    return RoundContribution(HEAT_SECRET_NAME, stages={HEAT_STAGE: coins})


HEAT_SECRET = Feature(HEAT_SECRET_NAME, contribute_heat_secret)


# ---- the private rounds on a runtime whose server talks to the nodes (Flower) -------------
# The runtime reads the run's privacy through these, and gets privacy's own protocols
# (privacy/*_protocol.py, in fedsub/feature_messages.py's terms) from here and from the
# assembler (runs/run_setup.py's ``NODE_PROTOCOLS``): it never names the privacy package.


def downloads_privately(schedule: Schedule) -> bool:
    """Whether the run's clients download privately (privacy.level: download or full)."""
    privacy = schedule.setting(Privacy)
    return privacy is not None and privacy.private_download


def sums_securely(schedule: Schedule) -> bool:
    """Whether the run's deltas go into the secure row sum (its privacy.level: full)."""
    privacy = schedule.setting(Privacy)
    return privacy is not None and privacy.secure_aggregation


def privacy_described(schedule: Schedule) -> dict:
    """The run's privacy level and its guarantees (privacy/levels.py's ``describe``; level
    none without [privacy])."""
    return describe(schedule.setting(Privacy) or Privacy())


def node_requests(
    schedule: Schedule, client: int, rows: dict[str, np.ndarray], table_rows: dict[str, int]
) -> NodeRequests | None:
    """A node's private download requests (privacy/download_protocol.py): client
    ``client``'s of its rows S(k); None below level download."""
    privacy = schedule.setting(Privacy)
    if privacy is None or not privacy.private_download:
        return None
    return NodeRequests(privacy, schedule.seed, client, rows, table_rows)


def download_combine(
    aggregation: Aggregation, schedule: Schedule
) -> Callable[[CohortUpdate], ServerUpdate]:
    """The round's aggregation: the algorithm's, row sums divided by p under randomized
    response (each held row reaches the server from a fraction p of its clients)."""
    privacy = schedule.setting(Privacy)
    keep = 1.0 if privacy is None else privacy.keep  # keep is 1 below level download
    return lambda update: unbias(aggregate(update, aggregation), keep)


class ServerHeat(Protocol):
    """Where a runtime's heat comes from when its server talks to the nodes
    (privacy/heat_protocol.py's ``HeatExchange``): the registered S(k), or the private
    exchange (``private``) over its protocol's messages (``carried``), kept as a checkpoint
    stage."""

    carried: Carried

    @property
    def privacy(self) -> HeatSource: ...

    @property
    def private(self) -> bool: ...

    @property
    def report(self) -> HeatReport | None: ...

    def measured(
        self, ask: Ask, nodes: Mapping[int, int], tables: Mapping[str, int], kind: HeatKind
    ) -> MeasuredHeat: ...

    def state_tensors(self) -> dict[str, torch.Tensor]: ...

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None: ...


def server_heat(privacy: HeatPrivacy | None = None) -> ServerHeat:
    """The heat of a run whose server talks to the nodes, by ``privacy`` (runs/run_setup.py's
    ``heat_privacy_of``; None: exact)."""
    return HeatExchange(privacy)


class SecureSum(Protocol):
    """The server's half of the secure row sums a runtime runs (privacy/secure_rows_protocol.py's
    ``SecureRows``): its first stages riding with the round's messages (``carried``), its
    combine."""

    carried: Carried

    def open(self, nodes: Sequence[int]) -> dict[int, dict]: ...

    @property
    def riding_with(self) -> Collection[int] | None: ...

    def take_keys(self, riding: Mapping[int, Fields]) -> dict[int, dict]: ...

    def take_shares(self, riding: Mapping[int, Fields]) -> None: ...

    def combine(self, update: CohortUpdate) -> ServerUpdate: ...


def secure_rows_of(
    schedule: Schedule,
    carrier: Callable[[Carried], Ask],
    node_of: Mapping[int, int],
    aggregation: Aggregation,
    requests: Callable[[], Mapping[int, Mapping[str, np.ndarray]]],
) -> SecureSum:
    """The server's half of the secure row sums (privacy/secure_rows_protocol.py) for a run
    at privacy.level ``full`` (``sums_securely``), its stages carried by ``carrier`` (the
    runtime's ``Ask`` for a protocol's own messages); with [dp]
    the nodes add the noise (distributed DP)."""
    privacy = schedule.setting(Privacy)
    if privacy is None or not privacy.secure_aggregation:
        raise FedsubError("a secure row sum needs privacy.level = 'full'")
    ask = carrier(SecureRows.carried)
    return SecureRows(ask, node_of, aggregation, privacy, requests, server_noise(schedule))
