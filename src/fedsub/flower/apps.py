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
from fedsub.flower.checkpoints import FlowerCheckpoints, config_stamp
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
        """The node's partition, sample count and index sets S(k)."""
        fed = federation(_settings(fixed, context))
        k = _partition(context, fed)
        rows = {
            f"rows.{t}": torch.from_numpy(fed.index.client_rows(t, k))
            for t in fed.dataset.table_rows
        }
        counts = int(fed.dataset.sample_counts()[k])
        metrics = MetricRecord({"partition-id": k, "num-examples": counts})
        return Message(
            RecordDict({"index": ArrayRecord(rows), "metrics": metrics}), reply_to=message
        )

    @app.train()
    def train(message: Message, context: Context) -> Message:
        """Local steps of fedsub's client work on the submodel received; reply row deltas."""
        settings = _settings(fixed, context)
        fed = federation(settings)
        k = _partition(context, fed)
        rows, received = read_submodel(record_of(message.content, "arrays", ArrayRecord))
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
            {"arrays": deltas_record(table_deltas, update.dense_deltas), "metrics": metrics}
        )
        return Message(content, reply_to=message)

    return app


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
        progress, checkpoints = None, None
        if settings.out_dir:
            out = Path(settings.out_dir)
            progress = JsonLines(out / "progress.jsonl")
            if not settings.resume:
                progress.path.unlink(missing_ok=True)
            checkpoints = FlowerCheckpoints(
                out / "checkpoints",
                settings.checkpoint_every,
                settings.resume,
                config_stamp(settings.model_description(config, name)),
            )
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
            min_nodes=settings.min_nodes or fed.dataset.num_clients,
            node_wait=settings.node_wait,
            heat_refresh_every=settings.heat_refresh_every,
            checkpoints=checkpoints,
            on_progress=progress,
        )
        evaluator = Evaluator.build(
            fed.model, fed.dataset, config.eval.train_loss_samples, config.data.seed
        )

        def evaluate(round_index: int, _: ArrayRecord) -> MetricRecord | None:
            every = settings.eval_every
            if not every or (round_index % every and round_index != fed.schedule.rounds):
                return None
            strategy.evaluations[round_index] = evaluator.evaluate(strategy.params)
            return MetricRecord(dict(strategy.evaluations[round_index]))

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
                result["evaluations"] = {str(r): m for r, m in strategy.evaluations.items()}
            else:
                kind = "diverged" if isinstance(failure, Diverged) else "failed"
                result[kind] = {"round": failure.round, "reason": failure.reason}
            write_atomic(out / "flower-result.json", dumps(result, indent=2) + "\n")
        if failure is not None:  # the ServerApp exits with an error: the run did not succeed
            raise FedsubError(f"Flower: {failure}") from failure

    return app
