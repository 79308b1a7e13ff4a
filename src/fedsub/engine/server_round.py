"""The server half of a round, written once: the round loop (engine/loop.py) drives it for
every runtime (in process, Flower), so every run screens updates, checks finiteness and stops
with ``Diverged`` the same way.

``begin(r)`` samples round r's cohort and describes its client work (``RoundFeatures.draw``:
algorithms/sampling.py's ``draw_cohort`` as the features take part; client/work.py's
``round_work``; SCAFFOLD's corrections); ``server_step(plan, update)`` screens the clients'
updates (engine/guards.py), combines them (``RoundFeatures.combined``) and checks the
aggregate is finite, and its ``ServerStep`` applies the server optimizer, checks the model
stays finite and updates the control variates (the loop times the two apart). What a
feature adds comes in ``features`` (engine/contribution.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fedsub.algorithms.registry import Algorithm
from fedsub.algorithms.server_optimizer import ServerOptimizer
from fedsub.client.work import round_work
from fedsub.engine.contribution import Combine, RoundContribution, RoundFeatures, Stages, Variates
from fedsub.engine.guards import (
    Diverged,
    kept,
    needs_screening,
    nobody,
    screen,
    touched_nonfinite,
)
from fedsub.engine.schedule import RoundPlan, Schedule
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import Updates

__all__ = ["HOST_READS_PER_ROUND", "Diverged", "RoundPlan", "ServerRound", "ServerStep"]

ServerStep = Callable[[], bool]
"""A round's server step, its aggregate checked (``ServerRound.server_step``): applies it and
says the model changed; raises ``Diverged`` if the model overflowed."""

# How often a round of the batched backend's torch kernels (a GPU's) reads the device from the
# host, with server SGD (FedAvg, FedSubAvg; adaptive server optimizers may add their own):
# ``cohort_batches`` reads the visited samples' id counts and the row unions' sizes once,
# ``finish`` reads its checks twice; no op waits for a value-dependent size. Evaluations,
# progress and checkpoints read more; tests/test_host_syncs.py counts them.
HOST_READS_PER_ROUND = 3


@dataclass
class ServerRound:
    """Cohort sampling, client work and the checked application of a round's updates.

    ``combine`` turns the (screened) cohort update into the server's update (plain aggregation,
    or what a feature built: engine/contribution.py); a model-average update (Scheme II)
    becomes the change of the whole model (``RoundFeatures.combined``), for every runtime.
    ``variates``: the algorithm's control variates (SCAFFOLD), None without.
    ``features``: what the run's features contributed (a combine override, stages, the
    cohort's key, how processes agree) and its ``Safety`` (screening, the last checkpoint
    ``Diverged`` names, kept current through ``checkpointed``)."""

    algorithm: Algorithm
    schedule: Schedule
    counts: np.ndarray
    params: Params
    server: ServerOptimizer  # the algorithm's (make_server)
    combine: Combine
    variates: Variates | None = None
    features: RoundFeatures = field(default_factory=RoundFeatures)

    @property
    def last_checkpoint(self) -> Path | None:
        return self.features.safety.last_checkpoint

    def checkpointed(self, path: Path | None) -> None:
        """``path`` is the last good checkpoint (written, or resumed from)."""
        self.features.safety.last_checkpoint = path

    def stages(self) -> Stages:
        """Every stateful stage of the round by name: what a checkpoint saves and a resume
        restores (engine/checkpoint.py), each through ``state_tensors`` /
        ``load_state_tensors``: the model, the server optimizer, the control variates, then
        each feature's (``RoundContribution.stages``)."""
        stages: Stages = {"model": self.params, "server": self.server}
        if self.variates is not None:
            stages["variates"] = self.variates
        return self.features.stages(stages)

    def repopulate(self, algorithm: Algorithm, counts: np.ndarray, combine: Combine) -> None:
        """The population changed (Flower's elastic membership): the algorithm built over it,
        its sample counts and combine replace the old ones; the server optimizer keeps its
        state (a fresh one of the new algorithm, loaded with the running one's)."""
        server = algorithm.make_server(self.params)
        server.load_state_tensors(self.server.state_tensors())
        self.algorithm, self.counts, self.server, self.combine = algorithm, counts, server, combine

    def wrapped(
        self,
        contribution: RoundContribution,
        schedule: Schedule | None = None,
        combine: Combine | None = None,
    ) -> None:
        """A runtime wrapped around these rounds (the virtual clock, clock/hooks.py) takes
        part: its contribution first in order (its stages, its override winning), and its own
        schedule (over-selection draws more) or combine (FedBuff's step) when it has them."""
        contributions = (contribution, *self.features.contributions)
        self.features = dataclasses.replace(self.features, contributions=contributions)
        self.schedule = schedule or self.schedule
        self.combine = combine or self.combine

    def begin(self, round_index: int, among: np.ndarray | None = None) -> RoundPlan:
        """Round r's cohort (the same for every runtime: keyed by round) and its work.

        ``among``: the clients that can take part (sorted positions; default all), e.g. the
        Flower nodes connected now; the sampler draws from them with the same key, so with
        every client present the cohort is the in-process engine's. The key is train.seed, or
        a feature's (``RoundContribution.draw.key``: a secret nobody outside can redraw
        the cohort from). A feature's ``draw.filter`` narrows ``among`` first (who may take
        part this round) and is told the cohort drawn."""
        a, schedule = self.algorithm, self.schedule
        cohort = self.features.draw(a.scheme.sampling, schedule, self.counts, round_index, among)
        step = schedule.client_step
        work = round_work(
            a.client, step, a.lr, self.counts, cohort.clients, round_index, a.scheme.scale_lr_by_pn
        )
        if self.variates is not None:
            work = dataclasses.replace(work, corrections=self.variates.corrections(cohort))
        return RoundPlan(round_index, cohort, work)

    def fail(self, plan: RoundPlan) -> ServerStep | None:
        """The round's work did not come back: nothing to apply (None: the model stays
        unchanged), unless a feature combines an empty round all the same
        (``RoundFeatures.combines_empty``)."""
        if not self.features.combines_empty():
            return None
        return self.server_step(plan, nobody(self.params))

    def server_step(self, plan: RoundPlan, update: Updates) -> ServerStep | None:
        """Screen and combine the cohort's update: the server step that applies it (the loop
        times the two apart: "aggregation", "server step"), or None when every update was
        rejected (the model unchanged). Raises ``Diverged`` if the aggregate is not finite;
        the step raises it if the model overflowed, else applies the server optimizer,
        updates the control variates and returns True.

        Host syncs (``HOST_READS_PER_ROUND``): the checks are computed on the device and read
        twice, once before the server step (something to screen out? an aggregate that is not
        finite? both in one transfer: the aggregate is combined before the screening verdict
        is known, and combined again in the rare round that rejects a member) and once after
        it (did the model overflow?)."""
        r, work, last = plan.round, plan.work, self.last_checkpoint
        features, safety, params = self.features, self.features.safety, self.params
        features.before_finish(r)
        agree = features.agreement.agree
        suspect = needs_screening(update, safety.max_update_norm)
        server_update = features.combined(self.combine, update, r, params)
        checks = torch.stack([suspect, server_update.nonfinite().to(suspect.device)])
        to_screen, aggregate_bad = agree(checks.tolist())  # host read 1
        if to_screen:
            members, rejected = screen(update, r, safety.max_update_norm)
            for rejection in features.agreement.all_rejected(rejected):
                if safety.on_reject is not None:
                    safety.on_reject(rejection)
            if not agree([bool(members)])[0] and not features.combines_empty():
                return None
            # a round without members may still combine (a mechanism's noise: an unchanged
            # model would tell that every member was rejected)
            update = kept(update, members, params)
            if self.variates is not None:  # only the variates read the members' work
                work = work.select(members)
            server_update = features.combined(self.combine, update, r, params)
            aggregate_bad = agree([bool(server_update.nonfinite())])[0]
        if aggregate_bad:
            raise Diverged(self.algorithm.name, r, "the aggregate is not finite", last)

        def step() -> bool:
            self.server.apply(params, server_update)
            overflowed = bool(touched_nonfinite(params, server_update))  # host read 2
            if agree([overflowed])[0]:
                raise Diverged(self.algorithm.name, r, "the model overflowed", last)
            if self.variates is not None:
                self.variates.update(update, work, self.schedule.local_steps)
            return True

        return step
