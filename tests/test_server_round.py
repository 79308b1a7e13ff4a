"""ServerRound: the server half of a round, driven by the one round loop for every runtime.
A round whose update would make the model non-finite stops with Diverged naming the round, in
both runtimes; a client's non-finite update is screened out, not applied."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsub.algorithms.aggregation import aggregate
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged
from fedsub.engine.contribution import RoundFeatures, Safety
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.engine.server_round import Diverged, ServerRound
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import ClientUpdate, CohortUpdate

BIG = 3e38  # finite in float32; twice it is not
CLIENTS = 6


def finish(rounds, plan, update) -> bool:
    """The loop's checked server step (engine/loop.py ``run_round``): aggregate, then step."""
    step = rounds.server_step(plan, update)
    return step is not None and step()


def quadratic() -> tuple[FederatedDataset, SubmodelIndex]:
    """Six clients, one sample each, all on the single row of table w."""
    parts = [
        SampleSet({"w": Ragged.from_lists([[0]])}, np.ones(1, np.float32)) for _ in range(CLIENTS)
    ]
    dataset = FederatedDataset.from_clients("quadratic", {"w": 1}, parts, parts[0])
    return dataset, SubmodelIndex.build(dataset)


def cohort_update(clients: list[int], delta: float) -> CohortUpdate:
    rows = {"w": torch.zeros(1, dtype=torch.int64)}
    return CohortUpdate.from_clients(
        [ClientUpdate(k, 1.0, rows, {"w": torch.full((1, 1), delta)}, {}) for k in clients]
    )


def server_round(params: Params, rejections: list) -> ServerRound:
    dataset, index = quadratic()
    algorithm = build_algorithm("fedavg", AlgorithmContext(dataset, index, "samples", 3))
    return ServerRound(
        algorithm,
        Schedule(5, 3, LocalWork(1, 1, ClientStep(0.1)), seed=0),
        dataset.sample_counts(),
        params,
        algorithm.make_server(params),
        lambda update: aggregate(update, algorithm.aggregation),
        features=RoundFeatures(safety=Safety(on_reject=rejections.append)),
    )


def test_an_aggregate_that_is_not_finite_is_named_before_any_server_step():
    """ServerUpdate.nonfinite: NaN or Inf in a table row or a dense parameter, and nothing
    for an empty or finite update; finish raises Diverged on it without moving the model."""
    from fedsub.algorithms.aggregation import RowUpdate, ServerUpdate

    rows = torch.tensor([0, 2])
    finite = ServerUpdate({"w": RowUpdate(rows, torch.ones(2, 1))}, {"b": torch.zeros(3)})
    assert not bool(finite.nonfinite()) and not bool(ServerUpdate({}, {}).nonfinite())
    for bad in (float("nan"), float("inf")):
        table = ServerUpdate({"w": RowUpdate(rows, torch.tensor([[1.0], [bad]]))}, {})
        dense = ServerUpdate({}, {"b": torch.tensor([0.0, bad, 1.0])})
        assert bool(table.nonfinite()) and bool(dense.nonfinite())
    params = Params({"w": torch.zeros(1, 1)}, {})
    rounds = server_round(params, [])
    rounds.combine = lambda update: ServerUpdate(
        {"w": RowUpdate(torch.tensor([0]), torch.tensor([[float("nan")]]))}, {}
    )
    plan = rounds.begin(1)
    with pytest.raises(Diverged, match="the aggregate is not finite"):
        finish(rounds, plan, cohort_update(plan.cohort.clients.tolist(), 0.5))
    assert torch.equal(params.tables["w"], torch.zeros(1, 1))


def test_finish_raises_diverged_naming_the_round_when_the_model_overflows(tmp_path):
    params = Params({"w": torch.full((1, 1), BIG)}, {})
    rounds = server_round(params, [])
    rounds.checkpointed(tmp_path / "round-000002")
    plan = rounds.begin(3)
    assert len(plan.cohort) == 3 and plan.work.lr.shape == (3,)
    with pytest.raises(Diverged) as error:
        finish(rounds, plan, cohort_update(plan.cohort.clients.tolist(), BIG))
    assert error.value.round == 3 and error.value.reason == "the model overflowed"
    assert str(error.value).startswith("fedavg: the model overflowed at round 3")
    assert f"last good checkpoint: {tmp_path / 'round-000002'}" in str(error.value)


def test_finish_screens_out_a_non_finite_client_update_and_applies_the_rest():
    params = Params({"w": torch.zeros(1, 1)}, {})
    rejections: list = []
    rounds = server_round(params, rejections)
    plan = rounds.begin(1)
    clients = plan.cohort.clients.tolist()
    update = cohort_update(clients, 0.5)
    update.table_deltas["w"][0] = float("nan")  # the first member's only row
    assert finish(rounds, plan, update) is True
    assert [(r.client, r.round) for r in rejections] == [(clients[0], 1)]
    assert float(params.tables["w"][0, 0]) == pytest.approx(0.5)  # the mean of the others

    nothing_left = cohort_update(clients, float("inf"))
    assert finish(rounds, rounds.begin(2), nothing_left) is False
    assert float(params.tables["w"][0, 0]) == pytest.approx(0.5)  # unchanged


def test_needs_screening_flags_nan_or_inf_in_any_delta_and_norms_over_the_bound():
    """Without max_update_norm only NaN or Inf count, in any member's table rows or dense
    deltas (finite values whose squared norm overflows float64 are not suspect); with it, a
    member's norm over the bound counts too."""
    from fedsub.engine.guards import needs_screening, screen

    def update(table: float, dense: float, dtype=torch.float32) -> CohortUpdate:
        rows = {"w": torch.tensor([0, 1])}
        return CohortUpdate.from_clients(
            [
                ClientUpdate(k, 1.0, rows, {"w": torch.full((2, 1), v, dtype=dtype)}, {"b": d})
                for k, (v, d) in enumerate(
                    [
                        (0.5, torch.zeros(3, dtype=dtype)),
                        (table, torch.full((3,), dense, dtype=dtype)),
                    ]
                )
            ]
        )

    assert not bool(needs_screening(update(0.5, 0.5), 0.0))
    assert not bool(needs_screening(update(1e200, 1e200, torch.float64), 0.0))  # norm: inf
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert bool(needs_screening(update(bad, 0.5), 0.0))
        assert bool(needs_screening(update(0.5, bad), 0.0))
        assert bool(needs_screening(update(bad, 0.5), 10.0))
    assert bool(needs_screening(update(0.5, 4.0), 6.0))  # sqrt(2 * 0.25 + 3 * 16) = 6.96
    assert not bool(needs_screening(update(0.5, 4.0), 7.0))
    # a norm equal to the bound does not exceed it: kept, by the check and by screen
    exact = CohortUpdate.from_clients(
        [ClientUpdate(7, 1.0, {"w": torch.tensor([0, 1])}, {"w": torch.tensor([[3.0], [4.0]])}, {})]
    )
    assert not bool(needs_screening(exact, 5.0)) and screen(exact, 1, 5.0) == ([0], [])
    kept, rejected = screen(exact, 1, 4.99)
    assert kept == [] and [r.reason for r in rejected] == ["update norm 5 > 4.99"]
    rows = {"w": torch.tensor([0, 1])}
    pair = CohortUpdate.from_clients(  # norms 5 (at the bound: kept) and 10 (rejected)
        [
            ClientUpdate(7, 1.0, rows, {"w": torch.tensor([[3.0], [4.0]])}, {}),
            ClientUpdate(8, 1.0, rows, {"w": torch.tensor([[6.0], [8.0]])}, {}),
        ]
    )
    kept, rejected = screen(pair, 1, 5.0)
    assert kept == [0] and [(r.client, r.reason) for r in rejected] == [(8, "update norm 10 > 5")]


class OneRowGrid:
    """A stand-in for Flower's Grid: six nodes, each holding row 0 of table w."""

    def get_node_ids(self) -> list[int]:
        return [100 + k for k in range(CLIENTS)]

    def push_messages(self, messages) -> list:
        self.queued = list(messages)
        return list(range(len(self.queued)))

    def pull_messages(self, ids) -> list:
        return self.send_and_receive([self.queued[i] for i in ids])

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

        return [
            Message(
                RecordDict(
                    {
                        "index": ArrayRecord({"rows.w": torch.zeros(1, dtype=torch.int64)}),
                        "metrics": MetricRecord(
                            {"partition-id": m.metadata.dst_node_id - 100, "num-examples": 1}
                        ),
                    }
                ),
                reply_to=m,
            )
            for m in messages
        ]


class OverflowingGrid(OneRowGrid):
    """OneRowGrid whose messages get ids (as Flower's grids give them) and whose nodes reply
    to training with a delta of ``BIG`` on row 0."""

    def push_messages(self, messages) -> list:
        self.queued = list(messages)
        for i, m in enumerate(self.queued):
            m.metadata.__dict__["_message_id"] = str(i)
        return [str(i) for i in range(len(self.queued))]

    def pull_messages(self, ids) -> list:
        from flwr.app import Message, MessageType, MetricRecord, RecordDict

        from fedsub.flower.records import deltas_record

        replies = []
        for m in (self.queued[int(i)] for i in ids):
            if m.metadata.message_type != MessageType.TRAIN:
                replies += self.send_and_receive([m])
                continue
            partition = m.metadata.dst_node_id - 100
            metrics = MetricRecord({"partition-id": partition, "num-examples": 1})
            arrays = deltas_record({"w": torch.full((1, 1), BIG)}, {})
            replies.append(Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=m))
        return replies


@pytest.mark.usefixtures("flower_task_identity")
def test_flower_runtime_raises_diverged_naming_the_round_and_records_it():
    from fedsub.engine.loop import RunControl, run_round
    from fedsub.flower.server_runtime import FlowerRuntime, Served
    from fedsub.flower.settings import FlowerSettings, Nodes

    params = Params({"w": torch.full((1, 1), BIG)}, {})
    runtime = FlowerRuntime(
        OverflowingGrid(),  # type: ignore[arg-type]
        params,
        Served("fedavg", None, "samples"),
        Schedule(5, 3, LocalWork(1, 1, ClientStep(0.1)), seed=0),
        FlowerSettings(nodes=Nodes(min_nodes=1)),
    )
    rounds = runtime.open(RunControl())
    with pytest.raises(Diverged) as error:
        run_round(rounds, runtime, 2)
    assert error.value.round == 2 and error.value.reason == "the model overflowed"
    assert runtime.rounds[-1]["diverged"] == "the model overflowed"
    assert runtime.rounds[-1]["replies"] == 3  # the cohort of 3 replied


def test_the_overflow_check_reads_only_the_touched_rows_and_dense_parameters():
    """touched_nonfinite: a NaN in a row the round changed (or in a dense parameter) is found,
    one in a row it left alone is not, and a round that changed nothing is finite."""
    from fedsub.algorithms.aggregation import RowUpdate, ServerUpdate
    from fedsub.engine.guards import touched_nonfinite

    table = torch.zeros(4, 2)
    table[3] = float("nan")
    tables_only = Params({"t": table}, {})
    assert not bool(touched_nonfinite(tables_only, ServerUpdate({}, {})))
    changed = {"t": RowUpdate(torch.tensor([0, 1]), torch.zeros(2, 2))}
    assert not bool(touched_nonfinite(tables_only, ServerUpdate(changed, {})))
    changed = {"t": RowUpdate(torch.tensor([1, 3]), torch.zeros(2, 2))}
    assert bool(touched_nonfinite(tables_only, ServerUpdate(changed, {})))
    with_dense = Params({"t": torch.zeros(4, 2)}, {"b": torch.tensor([0.0, float("inf")])})
    assert bool(touched_nonfinite(with_dense, ServerUpdate({}, {})))
    every = {"t": RowUpdate(torch.arange(4), torch.zeros(4, 2))}  # every row: the table read whole
    assert bool(touched_nonfinite(tables_only, ServerUpdate(every, {})))
    finite = Params({"t": torch.zeros(4, 2)}, {})
    assert not bool(touched_nonfinite(finite, ServerUpdate(every, {})))
