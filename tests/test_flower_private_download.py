"""``train.privacy = download | full`` on Flower (fedsub.flower.private_download,
fedsub.flower.secure_rows): the strategy and the real ClientApp on an in-process grid
(tests/test_flower_heat_exchange.py's AppGrid) train the in-process engine's model; the server
never receives a node's S(k), and at ``full`` no delta; dropouts from the secure sum."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from fedsub import config as config_lib
from fedsub.errors import FedsubError
from fedsub.experiment import load_data
from fedsub.flower import secure_rows
from fedsub.flower.apps import make_client_app
from fedsub.flower.settings import FlowerSettings, Payload
from fedsub.privacy.levels import Privacy
from fedsub.privacy.requests import client_request
from fedsub.privacy.secagg import SecAggError
from fedsub.submodel.index import SubmodelIndex

from .test_flower import in_process_model
from .test_flower_heat_exchange import AppGrid, _private_strategy, task_identity  # noqa: F401

BASE = (
    "data.num_users=4",
    "train.clients_per_round=2",
    "train.algorithms=['fedsubavg']",
    "train.heat='samples'",
    "train.secagg_group=2",
    "train.privacy='download'",
)
FULL = ("train.privacy='full'",)  # overrides BASE's download
RANDOMIZED = ("train.download='randomized-response'", "train.download_keep=0.6")
BUCKETS = ("train.download='buckets'", "train.download_bucket=4")


class Recording(AppGrid):
    """AppGrid keeping every reply the server received (its whole view of the nodes)."""

    def __init__(self, app, num_nodes: int) -> None:
        super().__init__(app, num_nodes)
        self.received: list[Message] = []

    def pull_messages(self, message_ids):  # every wave, the strategy's and the test's
        replies = super().pull_messages(message_ids)
        self.received.extend(replies)
        return replies


def _run(overrides: tuple[str, ...], payload: Payload, rounds: int):
    settings = FlowerSettings(overrides=(*overrides, f"train.rounds={rounds}"), payload=payload)
    grid = Recording(make_client_app(settings), 4)
    strategy = _private_strategy(settings)
    for r in range(1, rounds + 1):
        messages = strategy.configure_train(r, ArrayRecord(), ConfigRecord(), grid)
        strategy.aggregate_train(r, grid.send_and_receive(messages))
    return strategy, grid


@pytest.mark.parametrize(
    ("download", "payload", "rounds"),
    [
        (BUCKETS, "submodel", 3),  # every held row requested: the local copy is never read
        (RANDOMIZED, "full", 3),  # the whole model comes: every held row is current
        (RANDOMIZED, "submodel", 1),  # round 1: the local copy is the initial model
        ((*FULL, *BUCKETS), "submodel", 3),  # secure row sums over Flower messages
        ((*FULL, *RANDOMIZED), "full", 2),
    ],
)
def test_private_download_on_flower_gives_the_in_process_model(
    download: tuple[str, ...], payload: Payload, rounds: int
):
    overrides = (*BASE, *download)
    strategy, _ = _run(overrides, payload, rounds)
    expected = in_process_model((*overrides, f"train.rounds={rounds}"))
    moved = False
    for name, value in strategy.params.state_dict().items():
        # full: fixed point with 2 nodes and clip 1 errs by <= 1e-9 per sum (README)
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)
        moved |= bool(value.abs().max() > 0)
    assert moved  # the comparison is not between two untouched models
    if (
        "train.download='randomized-response'" in download
    ):  # positive control: skipped rows and 1/p change the model
        plain = in_process_model((*BASE[:-1], f"train.rounds={rounds}"))
        assert any(not torch.allclose(v, plain[n]) for n, v in expected.items())
    assert [r["replies"] for r in strategy.rounds] == [2] * rounds


def _row_sets(message: Message) -> list[np.ndarray]:
    """Every row-id array a reply carries (its index record's rows.*)."""
    if "index" not in message.content:
        return []
    index = message.content["index"]
    assert isinstance(index, ArrayRecord)
    return [v.numpy() for k, v in index.to_torch_state_dict().items() if k.startswith("rows.")]


def test_the_server_receives_requests_never_a_nodes_rows():
    """What the server received (every reply): requests drawn as in process (seed, round,
    client) and held rows it requested, never S(k) itself; the requests differ from S(k)."""
    overrides = (*BASE, *RANDOMIZED, "train.download_epsilon=1.0")
    strategy, grid = _run(overrides, "submodel", 2)
    config = config_lib.load(None, (*overrides, "train.rounds=2"))
    dataset = load_data(config)
    index = SubmodelIndex.build(dataset)
    truth = [index.client_rows("features", k) for k in range(4)]
    sent = [rows for reply in grid.received for rows in _row_sets(reply)]
    assert sent  # requests and reply rows did reach the server
    for rows in sent:
        assert not any(np.array_equal(rows, s) for s in truth)
    privacy = Privacy("download", "randomized-response", 1.0, 0.6)
    cohort = strategy._round.begin(2).cohort.clients.tolist()
    for k in cohort:  # round 2's requests as the in-process engine draws them
        want = client_request(privacy, {"features": truth[k]}, dataset.table_rows, 0, 2, k)
        assert np.array_equal(strategy._sampled_rows[k]["features"], want["features"])


def test_a_node_at_download_refuses_to_send_its_rows():
    settings = FlowerSettings(overrides=(*BASE, *BUCKETS))
    grid = AppGrid(make_client_app(settings), 4)
    ask = Message(RecordDict({"query": ConfigRecord({"what": "rows"})}), 100, MessageType.QUERY)
    with pytest.raises(FedsubError, match=r"partition 0: train.privacy = 'download'.*never"):
        grid.app(ask, grid.contexts[100])


def test_held_rows_left_out_of_a_request_come_from_the_nodes_local_copy():
    """A node's model over S(k): requested rows as received; a held row not requested takes
    the value the node last received for it (at first the seeded initial model's)."""
    from flwr.app import Context

    from fedsub.engine.loop import initial_params
    from fedsub.flower.node_data import node_config_items, node_data
    from fedsub.flower.private_download import local_submodel
    from fedsub.submodel.params import Params

    settings = FlowerSettings(overrides=(*BASE, *RANDOMIZED, "model.init_std=0.1"))
    node = node_data(settings, node_config_items({"partition-id": 0, "num-partitions": 4}))
    held = node.rows["features"]
    assert len(held) >= 3
    context = Context(1, 100, {}, RecordDict(), {})
    start = initial_params(node.model, node.schedule)
    dense = {n: v.clone() for n, v in start.dense.items()}

    def receive(request: np.ndarray, values: torch.Tensor) -> torch.Tensor:
        rows = {"features": torch.from_numpy(request)}
        got = local_submodel(
            node, context, rows, Params({"features": values}, dense), {"features": request}
        )
        return got.tables["features"]

    width = start.tables["features"].shape[1]
    first = held[1:]  # the first held row is left out: the initial model's value
    sent = torch.full((len(first), width), 7.0)
    mine = receive(first, sent)
    torch.testing.assert_close(mine[0], start.tables["features"][held[0]])
    assert bool((mine[0] != 0).any())  # the initial value is not zero: a real check
    torch.testing.assert_close(mine[1:], sent)
    second = held[:1]  # now only the first: the others keep the 7s received last time
    mine = receive(second, torch.full((1, width), -2.0))
    assert bool((mine[0] == -2.0).all()) and bool((mine[1:] == 7.0).all())
    with pytest.raises(FedsubError, match="the rows received are not its request"):
        local_submodel(
            node,
            context,
            {"features": torch.from_numpy(held)},
            Params({"features": torch.zeros(len(held), width)}, dense),
            {"features": second},
        )


def _float_arrays(message: Message) -> list[np.ndarray]:
    """Every floating-point array of a reply's ArrayRecords."""
    arrays = []
    for record in message.content.values():
        if isinstance(record, ArrayRecord):
            for value in record.to_torch_state_dict().values():
                if value.is_floating_point():
                    arrays.append(value.numpy())
    return arrays


@pytest.mark.parametrize("level", ["download", "full"])
def test_at_full_the_server_receives_no_rows_and_no_delta(level):
    """Everything the server received in two rounds (query, train and secure-sum replies):
    at ``full`` no S(k), and every float array is empty or zero (no delta in the clear); the
    same check finds the deltas at ``download`` (positive control)."""
    overrides = (*BASE, *RANDOMIZED, f"train.privacy='{level}'")
    strategy, grid = _run(overrides, "submodel", 2)
    dataset = load_data(config_lib.load(None, (*overrides, "train.rounds=2")))
    index = SubmodelIndex.build(dataset)
    truth = [index.client_rows("features", k) for k in range(4)]
    for rows in (rows for reply in grid.received for rows in _row_sets(reply)):
        assert not any(np.array_equal(rows, s) for s in truth)
    floats = [a for reply in grid.received for a in _float_arrays(reply)]
    nonzero = [a for a in floats if a.size and np.abs(a).max() > 0]
    if level == "full":
        assert floats and not nonzero
        secure = [r for r in grid.received if r.metadata.message_type == secure_rows.MESSAGE_TYPE]
        assert {str(r.content["heat"]["stage"]) for r in secure} == {
            "advertise",
            "share",
            "mask",
            "unmask",
        }
        assert len(secure) == 2 * 4 * 2  # 2 rounds, 4 stages, 2 nodes
        assert bool(strategy.params.tables["features"].abs().max() > 0)  # it trained
    else:
        assert nonzero


def _first_round(overrides: tuple[str, ...], dropped: set[int]):
    """Round 1 at ``full`` with 3 of 4 nodes; the nodes in ``dropped`` vanish before their
    masked vector (after training and sharing keys)."""
    settings = FlowerSettings(overrides=(*overrides, "train.rounds=1"))
    grid = AppGrid(make_client_app(settings), 4)

    def drop(node: int, message: Message) -> bool:
        heat = message.content.get("heat")
        return (
            message.metadata.message_type == secure_rows.MESSAGE_TYPE
            and isinstance(heat, ConfigRecord)
            and heat["stage"] == "mask"
            and node in dropped
        )

    grid.drop = drop
    strategy = _private_strategy(settings)
    messages = strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid)
    strategy.aggregate_train(1, grid.send_and_receive(messages))
    return strategy


def test_a_node_dropping_from_the_secure_sum_is_left_out_and_too_many_fail():
    """3 nodes, t = 2: one drops after training and the round still updates the model, which
    differs from the no-dropout round only in the dropped node's rows S(k) (and the dense
    part); two drop and the round stops with secagg's error naming t."""
    overrides = (*BASE, *FULL, *BUCKETS, "train.clients_per_round=3")
    everyone = _first_round(overrides, set())
    cohort = everyone._round.begin(1).cohort.clients.tolist()
    gone = cohort[0]
    dropped = _first_round(overrides, {100 + gone})  # partition k is node 100 + k
    assert dropped.rounds[0]["updated"]
    diff = (everyone.params.tables["features"] - dropped.params.tables["features"]).abs()
    changed = np.flatnonzero(diff.amax(1).numpy() > 1e-7)
    dataset = load_data(config_lib.load(None, (*overrides, "train.rounds=1")))
    held = SubmodelIndex.build(dataset).client_rows("features", gone)
    assert len(changed) and set(changed.tolist()) <= set(held.tolist())
    failed = r"secure row sum over nodes \[.*\]: only 1 clients left.*t = 2"
    with pytest.raises(SecAggError, match=failed):
        _first_round(overrides, {100 + cohort[0], 100 + cohort[1]})


def test_the_server_app_at_full_writes_the_in_process_model(tmp_path):
    """The real ServerApp (called as Flower calls it) and ClientApp on the grid: the run at
    ``full`` succeeds and saves the in-process model."""
    from flwr.app import Context
    from safetensors.torch import load_file

    from fedsub.flower.apps import make_server_app

    overrides = (*BASE, *FULL, *BUCKETS, "train.rounds=2")
    settings = FlowerSettings(overrides=overrides, out_dir=str(tmp_path), round_timeout=30.0)
    grid = AppGrid(make_client_app(settings), 4)  # what the ServerApp uses of a Grid
    make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
    saved = load_file(tmp_path / "model.safetensors")
    for name, value in in_process_model(overrides).items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=1e-6)
