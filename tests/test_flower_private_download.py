"""``privacy.level = download | full`` on Flower (fedsub.privacy.download_protocol,
fedsub.privacy.secure_rows_protocol, carried by fedsub.flower.protocols): the strategy and
the real ClientApp on an in-process grid (tests/test_flower_heat_exchange.py's AppGrid)
train the in-process engine's model; the server never receives a node's S(k), and at
``full`` no delta; dropouts from the secure sum."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedsub import config as config_lib
from fedsub.errors import FedsubError
from fedsub.flower.apps import make_client_app
from fedsub.flower.protocols import message_type
from fedsub.flower.records import tensors_of
from fedsub.flower.settings import FlowerSettings, Output, Payload, Replies
from fedsub.privacy import secure_rows_protocol as secure_rows
from fedsub.privacy.levels import Privacy
from fedsub.privacy.requests import client_request
from fedsub.privacy.secagg import SecAggError
from fedsub.runs.run_setup import load_data
from fedsub.submodel.index import SubmodelIndex

from .flower_rounds import private_runtime, recorded, wide
from .test_flower import in_process_model
from .test_flower_heat_exchange import AppGrid

SECURE_ROWS_TYPE = message_type(secure_rows.SECURE_ROWS)  # "query.secure_rows"

pytestmark = pytest.mark.usefixtures("flower_task_identity")

BASE = (
    "data.num_users=4",
    "train.clients_per_round=2",
    "train.algorithms=['fedsubavg']",
    "train.heat='samples'",
    "privacy.secagg_group=2",
    "privacy.level='download'",
    "privacy.randomness='seeded'",  # the nodes draw the simulator's requests (compared below)
)
FULL = ("privacy.level='full'",)  # overrides BASE's download
RANDOMIZED = ("privacy.download='randomized-response'", "privacy.download_keep=0.6")
BUCKETS = ("privacy.download='buckets'", "privacy.download_bucket=4")


class Recording(AppGrid):
    """AppGrid keeping every message the server sent and every reply it received (its whole
    view of the nodes; every wave, the strategy's and the test's, goes through push and pull)."""

    def __init__(self, app, num_nodes: int) -> None:
        super().__init__(app, num_nodes)
        self.sent: list[Message] = []
        self.received: list[Message] = []

    def push_messages(self, messages):
        messages = list(messages)
        self.sent.extend(messages)
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        self.received.extend(replies)
        return replies


def _run(overrides: tuple[str, ...], payload: Payload, rounds: int):
    settings = FlowerSettings(overrides=(*overrides, f"train.rounds={rounds}"), payload=payload)
    grid = Recording(make_client_app(settings), 4)
    strategy = private_runtime(settings, grid)
    strategy.train(rounds)
    return strategy, grid


@pytest.mark.parametrize(
    ("download", "payload", "rounds"),
    [
        (BUCKETS, "submodel", 3),  # every held row requested
        (RANDOMIZED, "full", 3),  # the whole model comes: held rows not requested skipped
        (RANDOMIZED, "submodel", 4),  # skipped rows read as zero on the node and in process
        ((*FULL, *BUCKETS), "submodel", 3),  # secure row sums over Flower messages
        ((*FULL, *RANDOMIZED), "full", 2),
        ((*FULL, *RANDOMIZED), "submodel", 3),
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
        # full: fixed point with 2 nodes and clip 1 errs by <= 1e-9 per sum (privacy tutorial)
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)
        moved |= bool(value.abs().max() > 0)
    assert moved  # the comparison is not between two untouched models
    if (
        "privacy.download='randomized-response'" in download
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
    return [v.numpy() for k, v in tensors_of(index).items() if k.startswith("rows.")]


def test_the_server_receives_requests_never_a_nodes_rows():
    """What the server received (every reply): requests drawn as in process (seed, round,
    client) and held rows it requested, never S(k) itself; the requests differ from S(k)."""
    overrides = (*BASE, *RANDOMIZED, "privacy.download_epsilon=1.0")
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
    cohort = strategy.open().begin(2).cohort.clients.tolist()
    for k in cohort:  # round 2's requests as the in-process engine draws them
        want = client_request(privacy, {"features": truth[k]}, dataset.table_rows, 0, 2, k)
        assert np.array_equal(strategy.sampled.rows[k]["features"], want["features"])


def test_a_node_at_download_refuses_to_send_its_rows():
    settings = FlowerSettings(overrides=(*BASE, *BUCKETS))
    grid = AppGrid(make_client_app(settings), 4)
    node = wide(100)  # partition 0
    ask = Message(RecordDict({"query": ConfigRecord({"what": "rows"})}), node, MessageType.QUERY)
    with pytest.raises(FedsubError, match=r"partition 0: privacy.level = 'download'.*never"):
        grid.app(ask, grid.contexts[node])


@pytest.mark.parametrize("payload", ["submodel", "full"])
def test_held_rows_left_out_of_a_request_are_skipped_with_either_payload(payload):
    """A node's model over S(k): requested rows as received; a held row not requested reads
    as zero (it is skipped: the node trains without it), whether its current value came
    (payload full) or not (submodel), and whatever it received in earlier rounds."""
    from fedsub.engine.initial import initial_params
    from fedsub.flower.node_data import node_config_items, node_data
    from fedsub.privacy.requested_rows import local_submodel
    from fedsub.submodel.params import Params

    settings = FlowerSettings(overrides=(*BASE, *RANDOMIZED, "model.init_std=0.1"))
    node = node_data(settings, node_config_items({"partition-id": 0, "num-partitions": 4}))
    held = node.rows["features"]
    assert len(held) >= 3
    start = initial_params(node.model, node.schedule)
    dense = {n: v.clone() for n, v in start.dense.items()}
    table = start.tables["features"].clone()
    table[held] = 7.0  # the current global value of every held row

    def receive(request: np.ndarray) -> torch.Tensor:
        if payload == "full":
            rows, sent = {}, Params({"features": table}, dense)
        else:
            rows = {"features": torch.from_numpy(request)}
            sent = Params({"features": table[request]}, dense)
        got = local_submodel(node.rows, node.client, rows, sent, {"features": request})
        return got.tables["features"]

    mine = receive(held[1:])  # the first held row is left out
    assert bool((mine[0] == 0).all()) and bool((mine[1:] == 7.0).all())
    mine = receive(held[:1])  # now only the first: the others are skipped this round
    assert bool((mine[0] == 7.0).all()) and bool((mine[1:] == 0).all())
    if payload == "submodel":
        with pytest.raises(FedsubError, match="the rows received are not its request"):
            local_submodel(
                node.rows,
                node.client,
                {"features": torch.from_numpy(held)},
                Params({"features": table[held]}, dense),
                {"features": held[:1]},
            )


def _float_arrays(message: Message) -> list[np.ndarray]:
    """Every floating-point array of a reply's ArrayRecords."""
    arrays = []
    for record in message.content.values():
        if isinstance(record, ArrayRecord):
            for value in tensors_of(record).values():  # packed or not (flower/records.py)
                if value.is_floating_point():
                    arrays.append(value.numpy())
    return arrays


@pytest.mark.parametrize("level", ["download", "full"])
def test_at_full_the_server_receives_no_rows_and_no_delta(level):
    """Everything the server received in two rounds (query, train and secure-sum replies):
    at ``full`` no S(k), every float array is empty or zero (no delta in the clear) and no
    reply names a sample count; the same checks find the deltas and the counts at
    ``download`` (positive control)."""
    overrides = (*BASE, *RANDOMIZED, f"privacy.level='{level}'")
    strategy, grid = _run(overrides, "submodel", 2)
    dataset = load_data(config_lib.load(None, (*overrides, "train.rounds=2")))
    index = SubmodelIndex.build(dataset)
    truth = [index.client_rows("features", k) for k in range(4)]
    for rows in (rows for reply in grid.received for rows in _row_sets(reply)):
        assert not any(np.array_equal(rows, s) for s in truth)
    floats = [a for reply in grid.received for a in _float_arrays(reply)]
    nonzero = [a for a in floats if a.size and np.abs(a).max() > 0]
    counted = [reply for reply in grid.received if _names_a_count(reply)]
    if level == "full":
        assert floats and not nonzero
        assert counted == []  # no node's sample count: it weights the deltas inside the sum
        # the secure sum's four stages, two riding with the request query and the training
        # (2 rounds, 2 nodes): 4 waves a round, not 6 (query.heat: the heat, before round 1)
        stages = [
            (r.metadata.message_type, str(r.content["heat"]["stage"]))
            for r in grid.received
            if "heat" in r.content and r.metadata.message_type != "query.heat"
        ]
        secure = SECURE_ROWS_TYPE
        assert sorted(set(stages)) == [
            ("query", "advertise"),
            (secure, "mask"),
            (secure, "unmask"),
            ("train", "share"),
        ]
        assert len(stages) == 2 * 4 * 2
        kinds = {m.metadata.message_type for m in grid.sent} - {"query.heat"}
        assert kinds == {"query", "train", secure}
        assert bool(strategy.params.tables["features"].abs().max() > 0)  # it trained
    else:
        assert nonzero
        assert counted  # positive control: the train replies carry num-examples at download


def _names_a_count(message: Message) -> bool:
    """Whether a reply carries a per-node count in the clear: a ``num-examples`` key in any of
    its metric or config records."""
    return any(
        isinstance(record, (MetricRecord, ConfigRecord)) and "num-examples" in record
        for record in message.content.values()
    )


def _first_round(
    overrides: tuple[str, ...],
    dropped: set[int],
    fails: frozenset[int] = frozenset(),
    garbled: frozenset[int] = frozenset(),
):
    """Round 1 at ``full`` with 3 of 4 nodes; the nodes in ``dropped`` vanish before their
    masked vector (after training and sharing keys), those in ``fails`` raise in training
    (after advertising their keys with the request query), those in ``garbled`` train and
    share their keys but reply another partition's id (the server leaves the reply out)."""
    settings = FlowerSettings(overrides=(*overrides, "train.rounds=1"))
    app = make_client_app(settings)

    def node_app(message: Message, context) -> Message:
        training = message.metadata.message_type == MessageType.TRAIN
        if training and context.node_id in fails:
            raise RuntimeError("training failed on this node")
        reply = app(message, context)
        if training and context.node_id in garbled:
            reply.content["metrics"]["partition-id"] = 99
        return reply

    grid = Recording(node_app, 4)

    def drop(node: int, message: Message) -> bool:
        heat = message.content.get("heat")
        return (
            message.metadata.message_type == SECURE_ROWS_TYPE
            and isinstance(heat, ConfigRecord)
            and heat["stage"] == "mask"
            and node in dropped
        )

    grid.drop = drop
    strategy = private_runtime(settings, grid)
    strategy.step(1)
    strategy.grid = grid
    return strategy


def test_a_node_dropping_from_the_secure_sum_is_left_out_and_too_many_fail():
    """3 nodes, t = 2: one drops after training and the round still updates the model with
    the survivors' weighted mean: the secure sum normalizes by the survivors' total weight
    (draws x sample count, summed inside it), so every row the dropped node does not hold
    moves by the no-dropout step times D_all / D_survivors (computed here from the data's
    counts); two drop and the round stops with secagg's error naming t."""
    overrides = (*BASE, *FULL, *BUCKETS, "train.clients_per_round=3")
    start = private_runtime(FlowerSettings(overrides=overrides), None).params.tables["features"]
    everyone = _first_round(overrides, set())
    cohort = everyone.open().begin(1).cohort
    members = cohort.clients.tolist()
    gone = members[0]
    dropped = _first_round(overrides, {wide(100 + gone)})  # partition k: node wide(100 + k)
    assert dropped.rounds[0]["updated"]
    dataset = load_data(config_lib.load(None, (*overrides, "train.rounds=1")))
    counts = dataset.sample_counts()
    units = {k: int(m) * int(counts[k]) for k, m in zip(members, cohort.multiplicity, strict=True)}
    ratio = sum(units.values()) / (sum(units.values()) - units[gone])
    held = SubmodelIndex.build(dataset).client_rows("features", gone)
    step_all = everyone.params.tables["features"] - start
    step_dropped = dropped.params.tables["features"] - start
    others = np.setdiff1d(np.flatnonzero(step_all.abs().amax(1).numpy() > 1e-4), held)
    assert len(others)  # rows only the survivors updated
    torch.testing.assert_close(step_dropped[others], step_all[others] * ratio, rtol=1e-5, atol=1e-8)
    assert ratio > 1.05  # the check tells a renormalized step from the plain one
    failed = r"secure row sum over nodes \[.*\]: only 1 clients left.*t = 2"
    with pytest.raises(SecAggError, match=failed):
        _first_round(overrides, {wide(100 + members[0]), wide(100 + members[1])})


def _stage_of(message: Message) -> str | None:
    """The secure row sum's stage a message the server sent asks for alone (None: another)."""
    heat = message.content.get("heat")
    if message.metadata.message_type != SECURE_ROWS_TYPE:
        return None
    return str(heat["stage"]) if isinstance(heat, ConfigRecord) else None


def _unmasked(strategy) -> list[list[int]]:
    """The dropped nodes (secagg ids) of each secure row sum's unmask request the server sent
    (one request, sent to every survivor)."""
    dropped = {
        tuple(heat["dropped"])
        for m in strategy.grid.sent
        if m.metadata.message_type == SECURE_ROWS_TYPE
        and isinstance(heat := m.content.get("heat"), ConfigRecord)
        and heat["stage"] == "unmask"
    }
    return [list(d) for d in sorted(dropped)]


def test_a_node_failing_training_at_full_is_outside_the_secure_sum():
    """The secure sum's keys ride with the request query and its shares with the training: a
    node that advertised keys and then fails training sends no shares, so no mask of it is
    added and the round updates the model with the others' sum, left_out naming it; as when
    it drops after sharing (the existing dropout, its plan counting 3 members: the same
    step up to the fixed point's rounding). A node that trains and shares but whose reply
    the server leaves out is a dropout the unmasking recovers (its mask key from the
    survivors' Shamir shares): the same model as the failed one, bit for bit."""
    overrides = (*BASE, *FULL, *BUCKETS, "train.clients_per_round=3")
    start = private_runtime(FlowerSettings(overrides=overrides), None).params.tables["features"]
    everyone = _first_round(overrides, set())
    members = everyone.open().begin(1).cohort.clients.tolist()
    gone = wide(100 + members[0])
    failed = _first_round(overrides, set(), fails=frozenset({gone}))
    assert failed.rounds[0]["updated"] and failed.rounds[0]["left_out"] == [members[0]]
    assert _unmasked(failed) == [[]]  # outside the sum: no dropout to recover
    garbled = _first_round(overrides, set(), garbled=frozenset({gone}))
    assert garbled.rounds[0]["left_out"] == [members[0]]
    assert [len(dropped) for dropped in _unmasked(garbled)] == [1]  # recovered by unmasking
    masking = [m for m in garbled.grid.sent if _stage_of(m) == "mask"]
    assert gone not in {m.metadata.dst_node_id for m in masking} and len(masking) == 2
    after_sharing = _first_round(overrides, {gone})
    step = {
        name: run.params.tables["features"] - start
        for name, run in (("all", everyone), ("failed", failed), ("garbled", garbled))
    }
    assert torch.equal(step["failed"], step["garbled"])
    assert not torch.allclose(step["failed"], step["all"], atol=1e-6)  # it is not in the sum
    shared = after_sharing.params.tables["features"] - start
    torch.testing.assert_close(step["failed"], shared, rtol=0, atol=1e-6)


def test_a_failed_training_counts_against_the_threshold_fixed_over_the_nodes_asked():
    """t is fixed when the keys ride with the request query: the majority of the nodes asked
    (3 of 4: t = 2). One failing training and one dropping before its masked vector leave 1,
    and the sum is refused naming t; with 4 asked (t = 3) one failing training and one
    dropping leave 2, also refused, though 2 would be a majority of the 3 that trained. Two
    failing training leave 2 sharing, fewer than t before any vector is masked: the sum's
    four stages run anew after the training, over the 2 that replied (t = 2), and the round
    updates the model."""
    overrides = (*BASE, *FULL, *BUCKETS, "train.clients_per_round=3")
    members = _first_round(overrides, set()).open().begin(1).cohort.clients.tolist()
    first, second = wide(100 + members[0]), wide(100 + members[1])
    with pytest.raises(SecAggError, match=r"only 1 clients left.*t = 2"):
        _first_round(overrides, {second}, fails=frozenset({first}))
    everyone = (*BASE, *FULL, *BUCKETS, "train.clients_per_round=4")
    one_failed = _first_round(everyone, set(), fails=frozenset({first}))
    assert one_failed.rounds[0]["updated"]
    assert "advertise" not in {_stage_of(m) for m in one_failed.grid.sent}  # it rode
    with pytest.raises(SecAggError, match=r"only 2 clients left.*t = 3"):
        _first_round(everyone, {second}, fails=frozenset({first}))
    two_failed = _first_round(everyone, set(), fails=frozenset({first, second}))
    assert two_failed.rounds[0]["updated"] and len(two_failed.rounds[0]["left_out"]) == 2
    alone = [_stage_of(m) for m in two_failed.grid.sent if _stage_of(m)]
    assert sorted(set(alone)) == ["advertise", "mask", "share", "unmask"]  # run anew


def test_the_server_app_at_full_writes_the_in_process_model(tmp_path):
    """The real ServerApp (called as Flower calls it) and ClientApp on the grid: the run at
    ``full`` succeeds and saves the in-process model."""
    from flwr.app import Context
    from safetensors.torch import load_file

    from fedsub.flower.apps import make_server_app

    overrides = (*BASE, *FULL, *BUCKETS, "train.rounds=2")
    settings = FlowerSettings(
        overrides=overrides,
        output=Output(out_dir=str(tmp_path)),
        replies=Replies(round_timeout=30.0),
    )
    grid = AppGrid(make_client_app(settings), 4)  # what the ServerApp uses of a Grid
    make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
    saved = load_file(tmp_path / "model.safetensors")
    for name, value in in_process_model(overrides).items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=1e-6)


def _size(value) -> int:
    if isinstance(value, list):
        return sum(_size(v) for v in value)
    return 1 if isinstance(value, bool) else len(value) if isinstance(value, str | bytes) else 8


def _bytes_by_type(messages: list[Message]) -> dict[str, int]:
    """The reference count, by message type: every array's serialized bytes, every config or
    metric value's (8 per number, 1 per bool, a text's length), and every key."""
    totals: dict[str, int] = {}
    for m in messages:
        if m.has_error():
            continue
        size = 0
        for record in m.content.values():
            if isinstance(record, ArrayRecord):
                size += sum(len(k) + len(array.data) for k, array in record.items())
            else:
                size += sum(len(k) + _size(v) for k, v in record.items())
        totals[m.metadata.message_type] = totals.get(m.metadata.message_type, 0) + size
    return totals


WAVES = {  # a round's waves of messages (2 sampled nodes; at heat, rows asked once)
    "heat": ["query", "train"],
    "download": ["query", "train"],
    "full": [
        "query:advertise",
        "train:share",
        "query.secure_rows:mask",
        "query.secure_rows:unmask",
    ],
}


def test_the_server_app_records_each_levels_costs_per_round_and_node(tmp_path):
    """flower-result.json's ``costs``: per round and sampled node the bytes each way and the
    node's seconds of work, the server's CPU seconds, the run's means and the bytes by message
    type (equal to the bytes of every message the grid carried, counted here) and the round's
    waves (at ``full`` two of the secure sum's stages ride with the query and the training);
    the bytes a node sends grow with the level (secure sums at ``full``), as in process."""
    from flwr.app import Context

    from fedsub.flower.apps import make_server_app

    up = {}
    for level in ("heat", "download", "full"):
        download = RANDOMIZED if level != "heat" else ()  # below download: a no-op, refused
        base = BASE if level != "heat" else tuple(o for o in BASE if "randomness" not in o)
        overrides = (*base, *download, f"privacy.level='{level}'", "train.rounds=2")
        out = tmp_path / level
        settings = FlowerSettings(
            overrides=overrides,
            output=Output(out_dir=str(out)),
            replies=Replies(round_timeout=30.0),
        )
        grid = Recording(make_client_app(settings), 4)
        make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
        result = json.loads((out / "flower-result.json").read_text())
        costs = result["costs"]
        assert costs["level"] == level and costs["rounds"] == 2
        for record in result["rounds"]:
            nodes = record["costs"]["nodes"]
            assert sorted(nodes) == sorted(str(n) for n in record["nodes"])
            for node in nodes.values():
                assert node["bytes_down"] > 0 and node["bytes_up"] > 0
                assert node["client_seconds"] > 0
            assert record["costs"]["server_cpu_seconds"] > 0
        waves = result["rounds"][-1]["costs"]["waves"]  # round 1's has the setup's too
        assert all(w["seconds"] >= 0 and 1 <= w["messages"] <= 2 for w in waves), waves
        assert [w["what"] for w in waves] == WAVES[level]
        by_type = costs["bytes_by_message_type"]
        assert {t: v["down"] for t, v in by_type.items()} == _bytes_by_type(grid.sent)
        assert {t: v["up"] for t, v in by_type.items()} == _bytes_by_type(grid.received)
        up[level] = costs["bytes_up_per_client_round"]
    assert up["heat"] < up["full"] and up["download"] < up["full"]


class _Stop(Exception):
    """Ends a run as a killed ServerApp would: after its checkpoint of round 2."""


def test_a_private_run_on_flower_resumes_to_the_uninterrupted_model(tmp_path):
    """At ``full`` (randomized response, secure heat and secure row sums) a ServerApp stopped
    after round 2's checkpoint and resumed on restarted nodes (fresh contexts) ends with the
    uninterrupted run's model and the in-process one; the resumed run takes the heat from the
    checkpoint (no second exchange). The nodes' ids span Flower's unsigned 64-bit range (the
    checkpoint keeps the heat's contributors, ids >= 2^63 among them)."""
    from fedsub.engine.loop import RunControl, drive
    from fedsub.files.run_folder import RunIdentity, hash_config
    from fedsub.flower.apps import RUN_ID, latest
    from fedsub.flower.server_runtime import Observers

    overrides = (*BASE, *FULL, *RANDOMIZED, "train.rounds=4")
    settings = FlowerSettings(overrides=overrides, replies=Replies(round_timeout=30.0))
    stamp = RunIdentity(RUN_ID, hash_config("private resume"))
    folder = tmp_path / "checkpoints"

    def start(grid, resume: bool = False, on_progress=None):
        run = private_runtime(settings, grid).runtime
        run.observers = Observers(on_progress=on_progress)
        control = RunControl(folder, 1, run=stamp.as_json())
        if resume:
            control.resume = latest(folder, stamp)
        drive(run.open(control), run, run.schedule, control)
        return run

    straight = private_runtime(settings, AppGrid(make_client_app(settings), 4)).runtime
    drive(straight.open(RunControl()), straight, straight.schedule, RunControl())

    def kill_in_round_3(record: dict) -> None:
        if record.get("round") == 3 and "sent_to" in record:
            raise _Stop

    with pytest.raises(_Stop):
        start(AppGrid(make_client_app(settings), 4), on_progress=kill_in_round_3)
    restarted = Recording(make_client_app(settings), 4)  # the nodes' contexts are new
    resumed = start(restarted, resume=True)
    assert [r["round"] for r in resumed.rounds] == [1, 2, 3, 4]
    assert not any(m.metadata.message_type == "query.heat" for m in restarted.received)
    assert resumed.heat.report is not None and resumed.privacy.source == "secagg"
    contributors = resumed.heat.report.contributors  # read back from the checkpoint
    assert sorted(contributors) == sorted(restarted.contexts) and max(contributors) >= 2**63
    expected = in_process_model(overrides)
    for name, value in resumed.params.state_dict().items():
        torch.testing.assert_close(value, straight.params.state_dict()[name], rtol=0, atol=1e-12)
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)
    assert bool(resumed.params.tables["features"].abs().max() > 0)


def test_at_full_nodes_are_not_asked_to_evaluate_and_eval_needs_a_server_test_file():
    """Federated evaluation replies a node's sums, its sample counts among them: at ``full``
    the strategy sends no evaluation message even when one is due, and eval-every without
    the server's own test file is refused; at ``download`` the nodes are asked (control)."""
    from fedsub.errors import ConfigError

    for level, asked in (("full", False), ("download", True)):
        overrides = (*BASE, *BUCKETS, f"privacy.level='{level}'")
        settings = FlowerSettings(overrides=overrides, eval_every=1)
        grid = AppGrid(make_client_app(settings), 4)
        strategy = private_runtime(settings, grid)
        strategy.step(1)
        sent = recorded(grid)
        strategy.runtime.evaluate(1, strategy.params)
        evaluation = [m for m in sent if m.metadata.message_type == MessageType.EVALUATE]
        assert bool(evaluation) == asked, level
    config = FlowerSettings(overrides=(*BASE, *FULL)).fedsub_config()
    with pytest.raises(ConfigError, match=r"eval-every = 2 with privacy.level = 'full'"):
        FlowerSettings(eval_every=2).check_against(config)
    FlowerSettings(eval_every=0).check_against(config)  # no evaluation: accepted


@pytest.mark.parametrize(
    "weighting, units, scale",
    [
        ("samples", [2 * 4, 1 * 7], 1 / ((2 + 1) * 11 / 2)),  # m_k n_k; 1 / (sum m * W / N)
        ("scheme2", [4, 7], (1 / 11) * (2 / (2 + 1))),  # n_k; 1 / W * N / sum m
    ],
)
def test_each_node_is_told_its_own_part_of_the_rounds_weighting(weighting, units, scale):
    """What SecureRows tells each node (its draws, the public scale, whether its count
    enters) rebuilds, on the node, its weight units and coefficient as written out here, for
    a member drawn twice (m = 2, 1; sample counts n = 4, 7; W = 11, N = 2)."""
    from fedsub.algorithms.aggregation import Aggregation
    from fedsub.algorithms.weighting import SecureWeighting
    from fedsub.privacy.private_rounds import SecureRound
    from fedsub.submodel.transfer import CohortUpdate

    update = CohortUpdate(
        clients=torch.tensor([3, 5]),
        weights=torch.tensor([4.0, 7.0], dtype=torch.float64),
        multiplicity=torch.tensor([2, 1]),
        rows={"t": torch.tensor([0, 1])},
        row_owner={"t": torch.tensor([0, 1])},
        table_deltas={"t": torch.zeros(2, 3)},
        dense_deltas={},
    )
    requests = [{"t": np.array([0])}, {"t": np.array([1])}]
    aggregation = Aggregation(weighting, None, 11.0, 2)
    plan = SecureRound.plan(update, requests, aggregation, Privacy("full"), None)
    for j, count in enumerate([4, 7]):
        told = secure_rows._told(plan, None, j)
        assert told["clients"] == 2
        node = SecureWeighting((told["draws"],), bool(told["by-count"]), told["scale"], False)
        assert node.units(0, count) == units[j]
        assert node.coefficient(node.units(0, count)) == pytest.approx(units[j] * scale)
