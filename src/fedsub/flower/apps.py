"""Flower ``ServerApp`` running fedsub's algorithms: the engine's round loop over the Flower
runtime (flower/server_runtime.py); the nodes' ``make_client_app`` (flower/client_app.py) is
importable from here too.

The ServerApp sizes the model from the config and the spec (flower/run_model.py) and never
reads a client's samples: index sets and sample counts come from the nodes' query replies,
evaluation is federated (flower/federated_eval.py), plus an optional ``server-test-file`` the
server reads with the spec. ``FlowerSettings`` given to the factories fix the settings in code
(tests, scripts); without them they are read from the run config (``flwr run ...
--run-config``)."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import cast

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedsub import config as config_lib
from fedsub.engine.federated_metrics import server_test_metrics
from fedsub.engine.loop import drive
from fedsub.engine.round_records import RoundsFailed
from fedsub.engine.server_round import Diverged
from fedsub.errors import FedsubError
from fedsub.files.run_folder import Claim
from fedsub.flower.client_app import make_client_app, settings_of
from fedsub.flower.costs import MeteredGrid
from fedsub.flower.heat_exchange import Transcript
from fedsub.flower.out_dir import PROGRESS, claim_out_dir, run_control, run_stamp, write_result
from fedsub.flower.run_model import RunModel, run_model
from fedsub.flower.server_runtime import FlowerRuntime, Observers, Served
from fedsub.flower.settings import INITIAL_MODEL, FlowerSettings
from fedsub.runs.initial_model import starting_params
from fedsub.runs.report import JsonLines
from fedsub.runs.run_identity import RunIdentity
from fedsub.runs.run_session import holding
from fedsub.runs.run_setup import heat_privacy_of
from fedsub.submodel.heat import HeatKind
from fedsub.submodel.params import Params

__all__ = ["make_client_app", "make_server_app"]


def make_server_app(fixed: FlowerSettings | None = None) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        """Build the run from the run config (the model's sizes, the algorithm, which run the
        out-dir holds), then serve it (``_serve``)."""
        settings = settings_of(fixed, context)
        run = run_model(settings)  # sizes only: the server reads no client's samples
        config = run.config
        name = settings.algorithm_name(config)
        # round 0's model, a model file checked before the out-dir is touched
        start = starting_params(
            run.model, run.schedule, settings.deployment.initial_model, INITIAL_MODEL
        )
        claim = claim_out_dir(settings)
        with holding(claim):
            stamp = run_stamp(settings, claim, config_lib.to_toml(config), name)
            served = Served(name, config.algorithm_options(name), cast(HeatKind, config.train.heat))
            _serve(grid, settings, run, start, served, stamp, claim)

    return app


def _runtime(
    grid: Grid, settings: FlowerSettings, run: RunModel, start: Params, served: Served
) -> FlowerRuntime:
    """The run's Flower runtime from round 0's model ``start``: its nodes through ``grid``,
    measured (flower/costs.py)."""
    privacy = heat_privacy_of(run.config)
    observers = Observers(meter=MeteredGrid(grid))
    if settings.output.heat_transcript and privacy.source != "exact":
        observers = replace(observers, on_heat_reply=Transcript(), on_train_reply=Transcript())
    if settings.output.out_dir:
        progress = JsonLines(Path(settings.output.out_dir) / PROGRESS)
        observers = replace(observers, on_progress=progress)
    query: dict[str, int | str] = {}
    server_test = None  # read before any node is asked: a bad file fails the run at once
    if run.spec is not None:  # every node checks its spec against the run's
        query = {"spec-version": run.spec.version, "spec-hash": run.spec.hash}
        if settings.deployment.server_test_file:
            samples = run.spec.encode(Path(settings.deployment.server_test_file))
            server_test = functools.partial(server_test_metrics, run.model, samples=samples)
    min_nodes = settings.nodes.min_nodes or run.num_clients
    return FlowerRuntime(
        cast(Grid, observers.meter),  # a Grid: its methods, measured (flower/costs.py)
        start,
        served,
        run.schedule,
        replace(settings, nodes=replace(settings.nodes, min_nodes=min_nodes)),
        privacy,
        query,
        observers,
        server_test,
    )


def _serve(
    grid: Grid,
    settings: FlowerSettings,
    run: RunModel,
    start: Params,
    served: Served,
    stamp: RunIdentity,
    claim: Claim | None,
) -> None:
    """The ServerApp's run, its out-dir held by ``claim``: the engine's round loop over the
    Flower runtime, then the result (a run that fails before it has a result leaves the
    out-dir as it found it)."""
    control = run_control(settings, run, stamp)
    runtime = _runtime(grid, settings, run, start, served)
    failure: Diverged | RoundsFailed | None = None
    progress = None
    try:
        progress = drive(runtime.open(control), runtime, runtime.schedule, control)
    except (Diverged, RoundsFailed) as error:  # the run fails; the result says why, no model
        failure = error
    if claim is not None:  # a result to keep, even a failure's
        claim.training_started()
    if out := settings.output.out_dir:
        write_result(Path(out), settings, run, served.name, runtime, progress, failure)
    if failure is not None:  # the ServerApp exits with an error: the run did not succeed
        raise FedsubError(f"Flower: {failure}") from failure
