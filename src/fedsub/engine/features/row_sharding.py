"""Row-sharded tables (``execution.table_sharding = "rows"``, fedsub/sharding) as a feature:
each process draws and keeps its rows of the tables; the members run where their process is
and their row updates are routed to the rows' owners; the processes agree on each round's
checks, write one checkpoint of their shards, log each round's traffic, and score the
evaluation sets by shares."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from fedsub import distributed
from fedsub.algorithms.aggregation import Aggregation
from fedsub.algorithms.server_optimizer import ServerOptimizer
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine import placement
from fedsub.engine.contribution import (
    Combine,
    Combining,
    Evaluate,
    Feature,
    Placed,
    Processes,
    RoundContribution,
    RoundHooks,
    RoundSetup,
    taking,
)
from fedsub.engine.evaluate import Evaluator, eval_chunks
from fedsub.engine.features.host_tables import without_coefficients
from fedsub.engine.guards import Rejection
from fedsub.engine.initial import ModelFile, init_generator
from fedsub.errors import ConfigError
from fedsub.sharding.evaluation import ShardedScoring
from fedsub.sharding.initial import sharded_init
from fedsub.sharding.model_file import write_final_model
from fedsub.sharding.rounds import ShardedTables, ShardParams, agree, all_rejected
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import CohortUpdate

NAME = "row_sharding"
SETTING = 'execution.table_sharding = "rows"'


def place(setup: RoundSetup) -> Placed | None:
    """This process's rows of the initial model and the tables' partition. The initial model
    is the one-process draw, of which this process draws only its rows where it can
    (sharding/initial.py)."""
    model, algorithm, schedule = setup.model, setup.algorithm, setup.schedule
    if schedule.execution.table_sharding != "rows" or model is None:
        return None
    processes = distributed.joined()
    if processes is None:
        raise ConfigError(
            f"{SETTING} spreads the tables' rows over torchrun's "
            "processes, and this run has one process: start it with torchrun "
            '--nproc-per-node P (P >= 2), or set execution.table_sharding = "none"'
        )
    if algorithm.central or algorithm.aggregation.model_average:
        raise ConfigError(
            f"{SETTING} cannot run algorithm {algorithm.name!r}: it pools every sample in one "
            "client or averages models (Scheme II), rescaling every row every round"
        )
    dtype, device = schedule.execution.dtype, schedule.execution.device
    drawn = sharded_init(
        lambda generator: model.init(generator, dtype),
        lambda: init_generator(schedule.seed),
        processes,
    )
    params = ShardParams(
        {t: v.to(device) for t, v in drawn.tables.items()},
        {n: v.to(device) for n, v in drawn.dense.items()},
        drawn.partitions,
        drawn.rank,
    )
    return Placed(params, ShardedTables.of(params, algorithm.aggregation.coefficients))


@dataclass(frozen=True)
class ShardAgreement:
    """The processes' checks and rejections, agreed with one collective each."""

    def agree(self, flags: list[bool]) -> list[bool]:
        return agree(flags)

    def all_rejected(self, rejected: list[Rejection]) -> list[Rejection]:
        return all_rejected(rejected)


@dataclass(frozen=True)
class ShardSaver:
    """Every process writes its shard into one checkpoint (process 0 holds the folder and
    decides whether one is written)."""

    sharded: ShardedTables

    def writes(self, due: bool) -> bool:
        """Process 0's answer, for every process: it holds the folder."""
        return bool(distributed.all_gather(due, "agreeing where checkpoints go")[0])

    def save(self, folder: Path | None, checkpoint: checkpoint_lib.Checkpoint) -> Path:
        return checkpoint_lib.save_shard(folder, checkpoint, self.sharded.processes)


def sharded_evaluator(evaluator: Evaluator, sharded: ShardedTables) -> Evaluator:
    """``evaluator`` with each process scoring its share of the chunks, reading rows fetched
    from their owners (fedsub/sharding/evaluation.py): the metrics are one process's."""
    if evaluator.extra is not None or evaluator.l2:
        raise ConfigError(
            f"{SETTING} cannot evaluate gradient norms or a regularized "
            "loss: both read whole tables"
        )
    scoring = ShardedScoring(sharded, evaluator.model, eval_chunks)
    return dataclasses.replace(evaluator, outputs_of=scoring, batches={})


def contribute(setup: RoundSetup) -> RoundContribution | None:
    sharded = setup.earlier.get(NAME)
    if not isinstance(sharded, ShardedTables):
        return None
    algorithm = setup.algorithm

    def evaluate(evaluator: Evaluator) -> Evaluate:
        return sharded_evaluator(evaluator, sharded).evaluate

    def check(server: ServerOptimizer) -> None:
        placement.check_row_local(algorithm, server, "execution.table_sharding", ("rows", "none"))

    def combine(aggregation: Aggregation) -> Combine:
        return taking(CohortUpdate, sharded.combine(aggregation))

    return RoundContribution(
        NAME,
        client_stage=sharded.run,  # alone: the other stages are refused with it
        combining=Combining(aggregation=without_coefficients, combine=combine),
        hooks=RoundHooks(after_round=sharded.log_traffic),
        processes=Processes(ShardAgreement(), ShardSaver(sharded)),
        evaluator=evaluate,
        checks=check,
        handle=sharded,
    )


FEATURE = Feature(NAME, contribute, place)


def written_model(folder: Path | None, final: Params) -> ModelFile | None:
    """A row-sharded run's final model written as ``folder``'s one model.safetensors by every
    process together, each its own rows (a collective; sharding/model_file.py), or None: the
    model ``final`` is whole in this process (the run session writes it)."""
    return write_final_model(folder, final) if isinstance(final, ShardParams) else None
