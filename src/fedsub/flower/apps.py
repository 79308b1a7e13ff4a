"""Flower ``ServerApp`` and ``ClientApp`` running fedsub's algorithms.

Every node loads the run's fedsub dataset and keeps the partition ``partition-id`` of its
node config (``num-partitions`` must equal the dataset's number of clients). The ServerApp
builds the model from the same config, never reads a client's training data (index sets and
sample counts come from the nodes' query replies), and evaluates the global model on the
dataset's central test set.

Pass ``FlowerSettings`` to the factories to fix the settings in code (tests, scripts);
without them they are read from the run config (``flwr run ... --run-config``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedsub.checks import check_against_dataset
from fedsub.client.transforms import Chain
from fedsub.config import Config
from fedsub.data.federated import FederatedDataset
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.loop import initial_params
from fedsub.engine.schedule import Schedule
from fedsub.engine.sequential import train_submodel
from fedsub.engine.server_round import Diverged
from fedsub.errors import FedsubError
from fedsub.experiment import load_data, model_of, schedule_of
from fedsub.flower.heat_exchange import HeatReport, Transcript, answer_heat, privacy_of
from fedsub.flower.records import deltas_record, number_of, read_submodel, record_of
from fedsub.flower.settings import FlowerSettings
from fedsub.flower.strategy import RoundsFailed, SubmodelStrategy
from fedsub.json_values import dumps
from fedsub.models.base import Model
from fedsub.report import JsonLines, save_tensors_atomic, write_atomic
from fedsub.submodel.heat import HeatKind
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.transfer import pull, push


@dataclass(frozen=True)
class Federation:
    """A run's config, data, model and schedule, loaded once per process."""

    config: Config
    dataset: FederatedDataset
    index: SubmodelIndex
    model: Model
    schedule: Schedule


@lru_cache(maxsize=4)
def federation(settings: FlowerSettings) -> Federation:
    config = settings.fedsub_config()
    dataset = load_data(config)
    model = model_of(config, dataset)
    check_against_dataset(config, dataset, model)
    return Federation(config, dataset, SubmodelIndex.build(dataset), model, schedule_of(config))


def _settings(fixed: FlowerSettings | None, context: Context) -> FlowerSettings:
    return fixed if fixed is not None else FlowerSettings.from_run_config(dict(context.run_config))


def _partition(context: Context, fed: Federation) -> int:
    partition = int(context.node_config["partition-id"])
    expected = int(context.node_config.get("num-partitions", fed.dataset.num_clients))
    if expected != fed.dataset.num_clients or not 0 <= partition < expected:
        raise FedsubError(
            f"node config partition-id={partition} num-partitions={expected}, but "
            f"{fed.dataset.name} has {fed.dataset.num_clients} clients: start one node per client"
        )
    return partition


def make_client_app(fixed: FlowerSettings | None = None) -> ClientApp:
    app = ClientApp()

    @app.query()
    def report_index(message: Message, context: Context) -> Message:
        """The node's partition, and (query "index") its sample count and index sets S(k),
        or (query "rows") its S(k) only: what the download of X[S(k)] reveals anyway. A node
        whose train.heat_source is private refuses "index": its heat goes by query.heat."""
        fed = federation(_settings(fixed, context))
        k = _partition(context, fed)
        what = str(record_of(message.content, "query", ConfigRecord).get("what", "index"))
        private = privacy_of(fed.config).source != "exact"
        if what not in ("index", "rows", "partition"):
            raise FedsubError(f"partition {k}: unknown query {what!r}")
        if what == "index" and private:
            raise FedsubError(
                f"partition {k}: train.heat_source = {fed.config.train.heat_source!r}, so this "
                "node does not send its index sets and sample count in the clear"
            )
        metrics = MetricRecord({"partition-id": k})
        content = RecordDict({"metrics": metrics})
        if what in ("index", "rows"):
            content["index"] = ArrayRecord(
                {
                    f"rows.{t}": torch.from_numpy(fed.index.client_rows(t, k))
                    for t in fed.dataset.table_rows
                }
            )
        if what == "index":
            metrics["num-examples"] = int(fed.dataset.sample_counts()[k])
        return Message(content, reply_to=message)

    @app.query("heat")
    def exchange_heat(message: Message, context: Context) -> Message:
        """One stage of the private heat exchange (fedsub.flower.heat_exchange)."""
        fed = federation(_settings(fixed, context))
        k = _partition(context, fed)
        rows = {t: fed.index.client_rows(t, k) for t in fed.dataset.table_rows}
        return answer_heat(
            message,
            context,
            privacy_of(fed.config),
            cast(HeatKind, fed.config.train.heat),  # config.py has checked it
            fed.dataset.table_rows,
            rows,
            int(fed.dataset.sample_counts()[k]),
        )

    @app.train()
    def train(message: Message, context: Context) -> Message:
        """Local steps of fedsub's client work on the submodel received; reply row deltas."""
        settings = _settings(fixed, context)
        fed = federation(settings)
        k = _partition(context, fed)
        rows, received = read_submodel(record_of(message.content, "submodel", ArrayRecord))
        own = {t: torch.from_numpy(fed.index.client_rows(t, k)) for t in fed.dataset.table_rows}
        full = not rows
        if full:  # the whole model came: take S(k) locally
            pulled = pull(received, own)
        elif any(not torch.equal(rows[t], own[t]) for t in own):
            raise FedsubError(f"partition {k}: the rows received are not this node's S(k)")
        else:
            pulled = received
        c = record_of(message.content, "config", ConfigRecord)
        chain = Chain.from_description(json.loads(str(c["chain"])))
        samples = fed.index.client_samples(fed.dataset, k)
        trained = train_submodel(
            fed.model,
            pulled,
            samples,
            k,
            int(number_of(c, "round")),
            fed.schedule,
            chain,
            float(number_of(c, "lr")),
        )
        update = push(k, float(len(samples)), own, pulled, trained)
        table_deltas = update.table_deltas
        if full:  # reply as stock FedAvg would: the whole table
            table_deltas = {
                t: torch.zeros_like(received.tables[t]).index_copy_(0, own[t], d)
                for t, d in table_deltas.items()
            }
        if settings.train_delay:
            time.sleep(settings.train_delay)
        metrics = MetricRecord({"partition-id": k, "num-examples": len(samples)})
        content = RecordDict(
            {"deltas": deltas_record(table_deltas, update.dense_deltas), "metrics": metrics}
        )
        return Message(content, reply_to=message)

    return app


def write_heat(out: Path, report: HeatReport, transcript: Transcript | None) -> None:
    """What the private heat exchange measured (``heat.safetensors``: per table the heat of
    every row) and, if recorded, everything the server received in it."""
    measured = report.measured
    tensors = {f"heat.{t}": torch.from_numpy(h) for t, h in measured.heat.items()}
    save_tensors_atomic(out / "heat.safetensors", tensors)
    if transcript is not None:
        text = dumps({"source": measured.source, "replies": transcript.entries}) + "\n"
        write_atomic(out / "heat-transcript.json", text)


def make_server_app(fixed: FlowerSettings | None = None) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        settings = _settings(fixed, context)
        fed = federation(settings)
        config = fed.config
        name = settings.algorithm_name(config)
        settings.check_against(config)
        params = initial_params(fed.model, fed.schedule)
        progress, transcript = None, None
        privacy = privacy_of(config)
        if settings.heat_transcript and privacy.source != "exact":
            transcript = Transcript()
        if settings.out_dir:
            progress = JsonLines(Path(settings.out_dir) / "progress.jsonl")
            progress.path.unlink(missing_ok=True)
        strategy = SubmodelStrategy(
            params,
            name,
            config.algorithm_options(name),
            cast(HeatKind, config.train.heat),  # config.py has checked it against its choices
            fed.schedule,
            min_replies=settings.min_replies,
            max_failed_rounds=settings.max_failed_rounds,
            max_update_norm=config.train.max_update_norm,
            payload=settings.payload,
            on_progress=progress,
            privacy=privacy,
            on_heat_reply=transcript,
        )
        strategy.discover(grid, fed.dataset.num_clients, settings.round_timeout)
        if settings.out_dir and strategy.heat_report is not None:
            write_heat(Path(settings.out_dir), strategy.heat_report, transcript)
        evaluator = Evaluator.build(
            fed.model, fed.dataset, config.eval.train_loss_samples, config.data.seed
        )
        evaluations: dict[int, dict[str, float]] = {}

        def evaluate(round_index: int, _: ArrayRecord) -> MetricRecord | None:
            every = settings.eval_every
            if not every or (round_index % every and round_index != fed.schedule.rounds):
                return None
            evaluations[round_index] = evaluator.evaluate(strategy.params)
            return MetricRecord(dict(evaluations[round_index]))

        failure: Diverged | RoundsFailed | None = None
        try:
            strategy.start(
                grid,
                ArrayRecord(),
                num_rounds=fed.schedule.rounds,
                timeout=settings.round_timeout,
                train_config=ConfigRecord(),
                evaluate_fn=evaluate,
            )
        except (Diverged, RoundsFailed) as error:  # the run fails; the result says why, no model
            failure = error
        if settings.out_dir:
            out = Path(settings.out_dir)
            result: dict[str, object] = {
                "algorithm": name,
                "payload": settings.payload,
                "succeeded": failure is None,
                "rounds": strategy.rounds,
            }
            if failure is None:
                save_tensors_atomic(out / "model.safetensors", strategy.params.state_dict())
                result["evaluations"] = {str(r): m for r, m in evaluations.items()}
            else:
                kind = "diverged" if isinstance(failure, Diverged) else "failed"
                result[kind] = {"round": failure.round, "reason": failure.reason}
            write_atomic(out / "flower-result.json", dumps(result, indent=2) + "\n")
        if failure is not None:  # the ServerApp exits with an error: the run did not succeed
            raise FedsubError(f"Flower: {failure}") from failure

    return app
