"""Flower ``ServerApp`` and ``ClientApp`` running fedsub's algorithms.

Each node trains on its own data (flower/node_data.py: its own file read with the run's
feature spec, or a partition of a fedsub dataset). The ServerApp sizes the model from the
config and the spec (flower/run_model.py) and never reads a client's samples: index sets and
sample counts come from the nodes' query replies, evaluation is federated (the nodes report
sums on their held-out samples, flower/federated_eval.py), plus an optional
``server-test-file`` the server reads with the spec.

Pass ``FlowerSettings`` to the factories to fix the settings in code (tests, scripts);
without them they are read from the run config (``flwr run ... --run-config``).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedsub import config as config_lib
from fedsub.client.transforms import Chain
from fedsub.engine.checkpoint import Checkpoint
from fedsub.engine.federated_metrics import server_test_metrics
from fedsub.engine.loop import Progress, RunControl, drive
from fedsub.engine.round_records import RoundsFailed, run_costs
from fedsub.engine.sequential import train_submodel
from fedsub.engine.server_round import Diverged
from fedsub.errors import FedsubError
from fedsub.files.atomic_files import TEMP_PATTERN
from fedsub.files.json_values import dumps
from fedsub.files.run_folder import (
    CHECKPOINTS,
    RUN_FILE,
    Claim,
    RunIdentity,
    checkpoint_outputs,
    hash_config,
)
from fedsub.files.tensor_files import write_tensors_atomic
from fedsub.flower.costs import MeteredGrid, with_seconds
from fedsub.flower.federated_eval import (
    EVAL_INDEX,
    node_report,
)
from fedsub.flower.heat_exchange import HeatReport, Transcript, answer_heat
from fedsub.flower.initial_model import starting_params
from fedsub.flower.node_data import NodeData, node_config_items, node_data
from fedsub.flower.private_download import downloads_privately, node_request
from fedsub.flower.records import deltas_record, number_of, read_submodel, record_of, rows_record
from fedsub.flower.run_model import RunModel, run_model
from fedsub.flower.secure_rows import (
    ACTION,
    NodeNoise,
    answer_secure_rows,
    empty_deltas,
    keep_deltas,
)
from fedsub.flower.server_runtime import FlowerRuntime, Observers, Served
from fedsub.flower.settings import OUT_DIR_FLAGS, FlowerSettings
from fedsub.numerics.float32 import ieee_float32
from fedsub.privacy.levels import Privacy, describe
from fedsub.privacy.requested_rows import local_submodel, reply_record
from fedsub.runs.report import JsonLines, write_atomic
from fedsub.runs.run_identity import (
    StartedWith,
    claim_folder,
    newest_checkpoint,
    resumed_identity,
    start_run,
)
from fedsub.runs.run_session import MODEL_FILE, checkpointed, holding, start_fresh, write_model
from fedsub.runs.run_setup import heat_privacy_of
from fedsub.submodel.heat import HeatKind
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import pull, push

LOG = logging.getLogger("fedsub")


def _settings(fixed: FlowerSettings | None, context: Context) -> FlowerSettings:
    return fixed if fixed is not None else FlowerSettings.from_run_config(dict(context.run_config))


def _own_data(fixed: FlowerSettings | None, context: Context) -> NodeData:
    """This node's data (for protocol stages: its spec was checked when it registered)."""
    return node_data(_settings(fixed, context), node_config_items(dict(context.node_config)))


def _node(fixed: FlowerSettings | None, context: Context, message: Message) -> NodeData:
    """This node's data, checked against the run's feature spec named in the message."""
    node = _own_data(fixed, context)
    config = message.content.get("query", message.content.get("config"))
    run_version, run_hash = 0, ""
    if isinstance(config, ConfigRecord) and "spec-hash" in config:
        run_version, run_hash = int(number_of(config, "spec-version")), str(config["spec-hash"])
    node.check_spec(run_version, run_hash)
    return node


def answer_query(fixed: FlowerSettings | None, message: Message, context: Context) -> Message:
    """The node's partition, and (query "index") its sample count, index sets S(k) and
    evaluation rows, or (query "rows") its S(k) only: what the download of X[S(k)] reveals
    anyway; at privacy.level download (query "request") its download request for the
    round instead, never S(k) (flower/private_download.py). A node whose
    privacy.heat_source is private refuses "index": its heat goes by query.heat."""
    node = _node(fixed, context, message)
    k = node.client
    query = record_of(message.content, "query", ConfigRecord)
    what = str(query.get("what", "index"))
    private = heat_privacy_of(node.config).source != "exact"
    if what not in ("index", "rows", "partition", "request"):
        raise FedsubError(f"partition {k}: unknown query {what!r}")
    downloading = downloads_privately(node.schedule.privacy)
    if what == "rows" and downloading:
        raise FedsubError(
            f"partition {k}: privacy.level = {node.config.privacy.level!r}, so this node "
            "sends a download request (query 'request'), never its rows S(k)"
        )
    if what == "request" and not downloading:
        raise FedsubError(
            f"partition {k}: privacy.level = {node.config.privacy.level!r} draws no "
            "private download request; ask for its rows"
        )
    if what == "index" and private:
        raise FedsubError(
            f"partition {k}: privacy.heat_source = {node.config.privacy.heat_source!r}, so "
            "this node does not send its index sets and sample count in the clear"
        )
    metrics = MetricRecord({"partition-id": k})
    content = RecordDict({"metrics": metrics})
    if what in ("index", "rows"):
        content["index"] = rows_record(node.rows)
    if what == "request":  # privacy download: its request for the round, never S(k)
        content["index"] = rows_record(node_request(node, int(number_of(query, "round"))))
    if what == "index":
        metrics["num-examples"] = len(node.train)
        content[EVAL_INDEX] = rows_record(node.eval_rows())
    return Message(content, reply_to=message)


def answer_train(fixed: FlowerSettings | None, message: Message, context: Context) -> Message:
    """Local steps of fedsub's client work on the submodel received; reply row deltas."""
    settings = _settings(fixed, context)
    node = _own_data(fixed, context)
    k = node.client
    rows, received = read_submodel(record_of(message.content, "arrays", ArrayRecord))
    own = {t: torch.from_numpy(r) for t, r in node.rows.items()}
    c = record_of(message.content, "config", ConfigRecord)
    round_index = int(number_of(c, "round"))
    downloading = downloads_privately(node.schedule.privacy)
    full = not rows
    request = node_request(node, round_index) if downloading else {}
    if downloading:  # requested rows received, the other held rows skipped (zero)
        pulled = local_submodel(node.rows, node.client, rows, received, request)
    elif full:  # the whole model came: take S(k) locally
        pulled = pull(received, own)
    elif any(not torch.equal(rows[t], own[t]) for t in own):
        raise FedsubError(f"partition {k}: the rows received are not this node's S(k)")
    else:
        pulled = received
    chain = Chain.from_description(json.loads(str(c["chain"])))
    samples = node.samples
    with ieee_float32():  # float32 means float32 on a node's GPU too, as in loop.train
        trained = train_submodel(
            node.model,
            pulled,
            samples,
            k,
            round_index,
            node.schedule,
            chain,
            float(number_of(c, "lr")),
        )
    update = push(k, float(len(samples)), own, pulled, trained)
    table_deltas = update.table_deltas
    index = None
    dense_deltas = update.dense_deltas
    metrics = MetricRecord({"partition-id": k, "num-examples": len(samples)})
    if downloading:  # the held rows it requested, with their ids (the others skipped)
        kept, table_deltas = reply_record(node.rows, request, table_deltas)
        privacy = node.schedule.privacy
        if privacy is not None and privacy.secure_aggregation:  # kept for the secure sum
            keep_deltas(context, kept, table_deltas, dense_deltas, round_index)
            kept, table_deltas, dense_deltas = empty_deltas(table_deltas, dense_deltas)
            del metrics["num-examples"]  # its count weights its deltas inside the sum
        index = rows_record(kept)
    elif full:  # reply as stock FedAvg would: the whole table
        table_deltas = {
            t: torch.zeros_like(received.tables[t]).index_copy_(0, own[t], d)
            for t, d in table_deltas.items()
        }
    if settings.replies.train_delay:
        time.sleep(settings.replies.train_delay)
    content = RecordDict({"arrays": deltas_record(table_deltas, dense_deltas), "metrics": metrics})
    if index is not None:
        content["index"] = index
    return Message(content, reply_to=message)


def make_client_app(fixed: FlowerSettings | None = None) -> ClientApp:
    app = ClientApp()

    @app.query()
    @with_seconds
    def report_index(message: Message, context: Context) -> Message:
        """The node's registration or row query answer (``answer_query``)."""
        return answer_query(fixed, message, context)

    @app.query("heat")
    def exchange_heat(message: Message, context: Context) -> Message:
        """One stage of the private heat exchange (fedsub.flower.heat_exchange)."""
        node = _own_data(fixed, context)
        return answer_heat(
            message,
            context,
            heat_privacy_of(node.config),
            cast(HeatKind, node.config.train.heat),  # config.py has checked it
            node.table_rows,
            node.rows,
            len(node.train),
        )

    @app.query(ACTION)
    @with_seconds
    def secure_rows(message: Message, context: Context) -> Message:
        """One stage of the secure sum of row deltas (fedsub.flower.secure_rows); with [dp]
        at level full this node adds its noisy share (distributed DP)."""
        node = _own_data(fixed, context)
        if node.schedule.privacy is None:
            raise FedsubError(f"partition {node.client}: no privacy.level; refusing")
        seeded = _settings(fixed, context).dp_seeded_noise
        noise = NodeNoise.of(node.config, node.client, seeded)
        privacy, count = node.schedule.privacy, len(node.samples)
        return answer_secure_rows(message, context, privacy, count, noise)

    @app.train()
    @with_seconds
    def train(message: Message, context: Context) -> Message:
        """Local steps on the submodel received (``answer_train``)."""
        return answer_train(fixed, message, context)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        """Sums of the loss (and AUC histograms) of the rows received on this node's own
        held-out and training samples: no sample leaves the node."""
        node = _node(fixed, context, message)
        rows, received = read_submodel(record_of(message.content, "arrays", ArrayRecord))
        if not rows:  # the whole model came (a node that keeps its rows to itself)
            rows = {t: torch.arange(v.shape[0]) for t, v in received.tables.items()}
        report = node_report(node, rows, received)
        return Message(RecordDict({"metrics": report}), reply_to=message)

    return app


def write_heat(
    out: Path,
    report: HeatReport,
    transcript: Transcript | None,
    train_transcript: Transcript | None = None,
) -> None:
    """What the private heat exchange measured (``heat.safetensors``: per table the heat of
    every row) and, if recorded, everything the server received: in the queries, the heat
    exchange and the secure row sums (``replies``), and in the train replies
    (``train_replies``)."""
    measured = report.measured
    tensors = {f"heat.{t}": torch.from_numpy(h) for t, h in measured.heat.items()}
    write_tensors_atomic(out / "heat.safetensors", tensors)
    if transcript is not None:
        recorded = {"source": measured.source, "replies": transcript.entries}
        if train_transcript is not None:
            recorded["train_replies"] = train_transcript.entries
        write_atomic(out / "heat-transcript.json", dumps(recorded) + "\n")


PROGRESS = "progress.jsonl"  # every round's record, as it ends
RUN_ID = "flower"  # Flower gives each `flwr run` a new run id: the config hash identifies it
CONFIG_KEY = "config"  # run.json's key of the fedsub config as written

# What a Flower run writes in its out-dir (its run.json manifest; files/run_folder.py).
FLOWER_OUTPUTS = [
    RUN_FILE,
    PROGRESS,
    "flower-result.json",
    MODEL_FILE,
    "heat.safetensors",
    "heat-transcript.json",
    TEMP_PATTERN,
    *checkpoint_outputs(CHECKPOINTS),
]


def claim_out_dir(settings: FlowerSettings) -> Claim | None:
    """The out-dir, held for the run (run_folder's rules, as ``fedsub run``), or None."""
    if not settings.output.out_dir:
        return None
    output = settings.output
    return claim_folder(Path(output.out_dir), output.resume, output.overwrite, OUT_DIR_FLAGS)


def started_with(settings: FlowerSettings, algorithm: str) -> StartedWith:
    """How an out-dir keeps the config its run was started with: in run.json, its identity
    the hash of the config's description with the Flower settings that decide the model."""
    return StartedWith(
        key=CONFIG_KEY,
        describe=functools.partial(settings.description, algorithm=algorithm),
        settings=(
            " with this run config's algorithm, payload, heat-refresh-every and initial-model "
            "(the file's bytes)"
        ),
        flags=OUT_DIR_FLAGS,
    )


def make_server_app(fixed: FlowerSettings | None = None) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        """Build the run from the run config (the model's sizes, the algorithm, which run the
        out-dir holds), then serve it (``_serve``)."""
        settings = _settings(fixed, context)
        run = run_model(settings)  # sizes only: the server reads no client's samples
        config = run.config
        name = settings.algorithm_name(config)
        # round 0's model, a model file checked before the out-dir is touched
        start = starting_params(run.model, run.schedule, settings.deployment.initial_model)
        claim = claim_out_dir(settings)
        with holding(claim):
            stamp = run_stamp(settings, claim, config_lib.to_toml(config), name)
            served = Served(name, config.algorithm_options(name), cast(HeatKind, config.train.heat))
            _serve(grid, settings, run, start, served, stamp, claim)

    return app


def run_stamp(settings: FlowerSettings, claim: Claim | None, text: str, name: str) -> RunIdentity:
    """The stamp of the run's checkpoints: its config hash (runs/run_identity.py; ``text``, the
    fedsub config as written), a resumed run's after checking that the config given is that
    run's, a new run's written to its out-dir (``claim``)."""
    started = started_with(settings, name)
    if claim is None:
        return RunIdentity(RUN_ID, hash_config(started.describe(text)))
    if settings.output.resume:
        identity = resumed_identity(claim.folder, text, started)
    else:
        identity = start_run(claim, text, {"kind": "flower", "outputs": FLOWER_OUTPUTS}, started)
    return RunIdentity(RUN_ID, identity.config_hash)


def run_control(settings: FlowerSettings, run: RunModel, stamp: RunIdentity) -> RunControl:
    """How the loop keeps a Flower run safe: checkpoints in out-dir every checkpoint-every
    rounds (stamped ``stamp``), the newest of them continued with ``resume``. Divergence is a
    non-finite train loss only: a Flower run has no round-0 evaluation (no node has
    registered yet) for the rising-loss rule."""
    guards = RunControl(max_update_norm=run.config.train.max_update_norm, divergence_factor=0.0)
    output = settings.output
    if not output.out_dir:
        return checkpointed(guards, None, 0, stamp)
    out = Path(output.out_dir)
    if not output.resume:  # a new run: its claim moved a replaced run's checkpoints aside
        start_fresh(out, PROGRESS, checkpoints=False)
        return checkpointed(guards, out, output.checkpoint_every, stamp)
    saved = latest(out / CHECKPOINTS, stamp)
    LOG.info("resuming after round %d from %s", saved.round, saved.path)
    return checkpointed(guards, out, output.checkpoint_every, stamp, saved)


def latest(folder: Path, stamp: RunIdentity) -> Checkpoint:
    """The newest intact checkpoint in ``folder`` of the run ``stamp``: a resumed Flower run
    has one to continue (``resume = true`` with none is refused)."""
    saved = newest_checkpoint(folder, stamp, OUT_DIR_FLAGS)
    if saved is None:
        raise FedsubError(
            f"Flower run config: resume = true, but {folder} holds no checkpoint "
            "(set checkpoint-every > 0 in the run to resume, or drop resume to start over)"
        )
    return saved


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
    # the loop's evaluation cadence is the run config's eval-every (0: none, the last round
    # asks and gets nothing)
    schedule = replace(run.schedule, eval_every=settings.eval_every or run.schedule.rounds)
    failure: Diverged | RoundsFailed | None = None
    progress = None
    try:
        progress = drive(runtime.open(control), runtime, schedule, control)
    except (Diverged, RoundsFailed) as error:  # the run fails; the result says why, no model
        failure = error
    if claim is not None:  # a result to keep, even a failure's
        claim.training_started()
    if out := settings.output.out_dir:
        write_result(Path(out), settings, run, served.name, runtime, progress, failure)
    if failure is not None:  # the ServerApp exits with an error: the run did not succeed
        raise FedsubError(f"Flower: {failure}") from failure


def write_result(
    out: Path,
    settings: FlowerSettings,
    run: RunModel,
    name: str,
    runtime: FlowerRuntime,
    progress: Progress | None,
    failure: Diverged | RoundsFailed | None,
) -> None:
    """flower-result.json (the rounds' records, the costs, the evaluations or why the run
    failed), the model, and what a private heat source measured."""
    observers = runtime.observers
    if runtime.heat_report is not None:
        transcript = cast(Transcript | None, observers.on_heat_reply)
        train_transcript = cast(Transcript | None, observers.on_train_reply)
        write_heat(out, runtime.heat_report, transcript, train_transcript)
    totals = cast(MeteredGrid, observers.meter).totals
    result: dict[str, object] = {
        "algorithm": name,
        "payload": settings.payload,
        "succeeded": failure is None,
        "rounds": runtime.rounds,
        "costs": {
            **describe(run.schedule.privacy or Privacy()),
            **run_costs(runtime.rounds, totals),
        },
    }
    if failure is None and progress is not None:
        write_model(out, runtime.params)
        result["evaluations"] = {str(e.round): e.metrics for e in progress.history}
    elif failure is not None:
        kind = "diverged" if isinstance(failure, Diverged) else "failed"
        result[kind] = {"round": failure.round, "reason": failure.reason}
    write_atomic(out / "flower-result.json", dumps(result, indent=2) + "\n")
