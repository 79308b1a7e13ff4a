"""The private heat exchange over Flower Messages (fedsub.privacy.heat_protocol, over
fedsub.privacy.secure_sum and secagg_records, carried by fedsub.flower.protocols), on a grid
that hands each message to the node's real handler in process: its heat equals the in-process
sources', dropouts are handled by the threshold, and foreign or malformed replies are left out
naming the node."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode

from fedsub import config as config_lib
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm, heat_coefficients
from fedsub.data.federated import ClientSizes
from fedsub.errors import FedsubError
from fedsub.flower import protocols as carrier
from fedsub.privacy import heat_protocol
from fedsub.privacy import randomized_response as rr
from fedsub.privacy import secagg_records as records
from fedsub.privacy.heat_sources import HeatPrivacy, estimate_heat
from fedsub.privacy.heat_vectors import heat_from_reports
from fedsub.privacy.secagg import AdvertiseKeys, SecAggError, UnmaskRequest
from fedsub.privacy.secagg_records import HeatMessageError
from fedsub.privacy.secure_sum import measure_heat
from fedsub.runs.run_setup import load_data
from fedsub.submodel.index import SubmodelIndex

from .flower_rounds import narrow, private_runtime, recorded, wide

Handler = Callable[[Message, Context], Message]
HEAT = heat_protocol.HEAT
MESSAGE_TYPE = carrier.message_type(HEAT)  # "query.heat"


def answer_heat(message, context, privacy, kind, table_rows, rows, num_samples) -> Message:
    """A node's reply to one stage of the heat exchange, as its ClientApp gives it."""
    answer = heat_protocol.heat_answer(privacy, kind, table_rows, rows, num_samples)
    return carrier.answer(message, context, HEAT, answer)


def collect_heat(grid, nodes, privacy, kind, table_rows, timeout, record=None):
    """The heat of ``nodes`` by the exchange over ``grid``, as a Flower server runs it."""
    ask = carrier.asker(grid, timeout, record, HEAT)
    return measure_heat(ask, nodes, privacy, kind, table_rows)


def heat_fields(content: RecordDict, who: str):
    return carrier.fields_of(content, HEAT.record, who)


pytestmark = pytest.mark.usefixtures("flower_task_identity")


@pytest.fixture(scope="module")
def federation():
    config = config_lib.load(None, ["data.num_users=5"])
    dataset = load_data(config)
    return dataset, SubmodelIndex.build(dataset)


class AnsweredAtOnce:
    """Push and pull as Flower's grids do them: ``push_messages`` gives each message its id
    (a reply's ``reply_to_message_id``) and has it answered at once (``answer``);
    ``pull_messages`` returns the replies that arrived, once each. A message that gets no
    reply (a node that dropped out) is waited for until the caller's timeout."""

    def answer(self, messages: Iterable[Message]) -> list[Message]:
        raise NotImplementedError

    def send_and_receive(self, messages: Iterable[Message], *, timeout=None) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        self.arrived: dict[str, list[Message]] = getattr(self, "arrived", {})
        self.pushed: int = getattr(self, "pushed", 0)
        ids = []
        for message in messages:
            self.pushed += 1
            message.metadata.__dict__["_message_id"] = f"message-{self.pushed}"  # as Flower's
            ids.append(message.metadata.message_id)
            self.arrived[ids[-1]] = self.answer([message])
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [reply for i in message_ids for reply in self.arrived.pop(i, [])]


class LoopbackGrid(AnsweredAtOnce):
    """A Grid whose nodes answer in process, each with its own Context (its state persists
    across messages, as a SuperNode's does); ``tamper`` may replace a node's reply."""

    def __init__(self, handlers: dict[int, Handler]) -> None:
        self.handlers = handlers
        self.contexts = {n: Context(1, n, {}, RecordDict(), {}) for n in handlers}
        self.tamper: Callable[[int, str, Message], Message | None] = lambda n, s, m: m

    def answer(self, messages: Iterable[Message]) -> list[Message]:
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            stage = str(message.content["heat"]["stage"])
            assert message.metadata.message_type == MESSAGE_TYPE
            try:
                reply = self.handlers[node](message, self.contexts[node])
            except Exception as error:  # a ClientApp's exception comes back as an error reply
                reply = Message(Error(code=1, reason=str(error)), reply_to=message)
            sent = self.tamper(node, stage, reply)
            if sent is not None:  # None: the node dropped out
                replies.append(sent)
        return replies


def node_handlers(dataset, index, privacy, kind) -> dict[int, Handler]:
    """Node ids ``wide(101 + k)`` (across the uint64 range, not in client order) for clients
    0..N-1, each answering with its own S(k) and count."""
    counts = dataset.sample_counts()

    def handler(k: int) -> Handler:
        rows = {t: index.client_rows(t, k) for t in dataset.table_rows}
        return lambda m, c: answer_heat(
            m, c, privacy, kind, dataset.table_rows, rows, int(counts[k])
        )

    return {wide(101 + k): handler(k) for k in range(dataset.num_clients)}


@pytest.mark.parametrize("source", ["secagg", "sketch"])
@pytest.mark.parametrize("kind", ["clients", "samples"])
def test_secure_heat_over_messages_equals_the_in_process_source(federation, source, kind):
    dataset, index = federation
    privacy = HeatPrivacy(source, group_size=2, sketch_eps=0.05, sketch_delta=0.1)
    grid = LoopbackGrid(node_handlers(dataset, index, privacy, kind))
    received: list[tuple[int, str]] = []
    report = collect_heat(
        grid,
        sorted(grid.handlers),
        privacy,
        kind,
        dataset.table_rows,
        10.0,
        lambda node, stage, content: received.append((node, stage)),
    )
    expected = estimate_heat(dataset, index, kind, privacy)
    assert set(report.measured.heat) == set(expected)
    for table, heat in expected.items():
        np.testing.assert_array_equal(report.measured.heat[table], heat)
    assert report.measured.total_samples == dataset.sample_counts().sum()
    assert report.measured.num_clients == dataset.num_clients == len(report.contributors)
    # groups of 2 over 5 nodes, by node id: a lone tail joins the last group
    assert received.count((wide(105), "unmask")) == 1 and len(received) == 4 * 5
    assert set(report.contributors) == set(grid.handlers)
    assert all(heat_protocol.STATE not in c.state for c in grid.contexts.values())  # keys forgotten


def test_a_node_dropping_after_keys_is_left_out_and_too_few_fail(federation, caplog):
    dataset, index = federation
    privacy = HeatPrivacy("secagg", group_size=5)
    grid = LoopbackGrid(node_handlers(dataset, index, privacy, "clients"))
    grid.tamper = lambda node, stage, m: None if (node, stage) == (wide(103), "mask") else m
    with caplog.at_level(logging.WARNING, logger="fedsub"):  # waits 0.5 s for node 103
        report = collect_heat(
            grid, sorted(grid.handlers), privacy, "clients", dataset.table_rows, 0.5
        )
    assert f"stage mask: no reply from node {wide(103)}" in caplog.text
    assert sorted(report.contributors) == sorted(wide(n) for n in (101, 102, 104, 105))
    assert max(report.contributors) >= 2**63
    without = [k for k in range(dataset.num_clients) if k != 2]
    for table in dataset.table_rows:
        expected = np.zeros(dataset.table_rows[table])
        for k in without:
            expected[index.client_rows(table, k)] += 1
        np.testing.assert_array_equal(report.measured.heat[table], expected)
    assert report.measured.num_clients == 4
    # three of five drop before masking: fewer than t = 3 remain
    grid = LoopbackGrid(node_handlers(dataset, index, privacy, "clients"))
    grid.tamper = lambda node, stage, m: None if narrow(node) > 102 and stage == "mask" else m
    group = re.escape(str(sorted(grid.handlers)))
    with pytest.raises(SecAggError, match=rf"group of nodes {group}: only 2 clients left.*t = 3"):
        collect_heat(grid, sorted(grid.handlers), privacy, "clients", dataset.table_rows, 0.5)


def _reply_with(reply: Message, **changes) -> Message:
    """``reply`` with some of its heat fields replaced (a forged or broken reply)."""
    fields = {**dict(heat_fields(reply.content, "test")), **changes}
    request = Message(RecordDict(), reply.metadata.src_node_id, MESSAGE_TYPE)
    request.metadata.__dict__["_message_id"] = reply.metadata.reply_to_message_id  # the same
    return Message(RecordDict({"heat": ConfigRecord(fields)}), reply_to=request)


def test_foreign_replies_are_left_out_naming_the_node(federation, caplog):
    dataset, index = federation
    privacy = HeatPrivacy("secagg", group_size=5)
    grid = LoopbackGrid(node_handlers(dataset, index, privacy, "clients"))
    bad: dict[tuple[int, str], dict[str, bytes | int]] = {
        (wide(101), "advertise"): {"session": b"another session!"},
        (wide(102), "share"): {"sender": 3},  # claims to be another node's client
    }
    grid.tamper = lambda node, stage, m: (
        _reply_with(m, **bad[node, stage]) if (node, stage) in bad else m
    )
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        report = collect_heat(
            grid, sorted(grid.handlers), privacy, "clients", dataset.table_rows, 5.0
        )
    client = sorted(grid.handlers).index(wide(102))  # its place in the group, by node id
    assert f"node {wide(101)}: heat message from another session; left out" in caplog.text
    assert f"node {wide(102)}: claims to be client 3 of its group, it is client {client}" in (
        caplog.text
    )
    assert sorted(report.contributors) == sorted(wide(n) for n in (103, 104, 105))
    expected = np.zeros(dataset.table_rows["features"])
    for k in (2, 3, 4):
        expected[index.client_rows("features", k)] += 1
    np.testing.assert_array_equal(report.measured.heat["features"], expected)


def test_malformed_heat_records_are_refused_naming_node_and_field():
    session = b"s" * 16
    masked = ConfigRecord({"stage": "mask", "session": session, "sender": 0, "values": b"1234567"})
    with pytest.raises(HeatMessageError, match="node 7: masked input of 7 bytes, expected 2"):
        records.decode_masked(masked, session, 2, "node 7")
    keys = ConfigRecord({"stage": "advertise", "session": session, "sender": "0"})
    with pytest.raises(HeatMessageError, match="node 7: heat message's 'sender' is a str"):
        records.decode_advertise(keys, session, "node 7")
    with pytest.raises(HeatMessageError, match="node 7: heat message of stage 'advertise', "):
        records.decode_unmask(keys, session, "node 7")
    with pytest.raises(FedsubError, match="node 7: not a heat message"):
        heat_fields(RecordDict({"metrics": ConfigRecord({"a": 1})}), "node 7")
    shares = ConfigRecord(
        {"self-owners": [0, 1], "self-x": [1], "self-y": [b"x" * 66], "stage": "unmask"}
    )
    with pytest.raises(HeatMessageError, match="node 7: heat message's self shares do not"):
        records._shares_of(shares, "self", "node 7")
    report = ConfigRecord({"stage": "report", "num-examples": 3, "bits.features": b"\x00"})
    with pytest.raises(HeatMessageError, match="1 bytes of bits for table 'features', exp"):
        records.decode_report(report, {"features": 100}, "node 7")


def test_a_node_answers_only_for_its_own_heat_source(federation):
    dataset, index = federation
    grid = LoopbackGrid(node_handlers(dataset, index, HeatPrivacy("sketch"), "clients"))
    request = records.advertise_request(b"s" * 16, 0, 3, "secagg")
    node = wide(101)
    message = Message(RecordDict({"heat": ConfigRecord(request)}), node, MESSAGE_TYPE)
    with pytest.raises(HeatMessageError, match=r"asks for heat source 'secagg'.*'sketch'"):
        grid.handlers[node](message, grid.contexts[node])
    exact = LoopbackGrid(node_handlers(dataset, index, HeatPrivacy("exact"), "clients"))
    with pytest.raises(HeatMessageError, match=r"privacy\.heat_source = 'exact'"):
        exact.handlers[node](message, exact.contexts[node])


@pytest.mark.parametrize("kind", ["clients", "samples"])
def test_randomized_response_estimate_equals_the_in_process_estimator(federation, kind):
    """Given the reports the in-process source draws (its seeded stream), the reports sent as
    messages give the in-process estimate."""
    dataset, index = federation
    privacy = HeatPrivacy("randomized-response", rr_epsilon=1.0, seed=3)
    counts = dataset.sample_counts()
    bits: list[dict[str, np.ndarray]] = [{} for _ in range(dataset.num_clients)]
    for table, size in dataset.table_rows.items():  # the in-process stream: one per table
        rng = np.random.default_rng([privacy.seed, 0x5151])
        for k in range(dataset.num_clients):
            bits[k][table] = rr.report(index.client_rows(table, k), size, 1.0, rng)
    sent = [
        records.decode_report(
            ConfigRecord(records.encode_report(b, int(n))), dataset.table_rows, f"node {k}"
        )
        for k, (b, n) in enumerate(zip(bits, counts, strict=True))
    ]
    measured = heat_from_reports(privacy, kind, dataset.table_rows, sent)
    expected = estimate_heat(dataset, index, kind, privacy)
    for table, heat in expected.items():
        np.testing.assert_allclose(measured.heat[table], heat, rtol=1e-12, atol=1e-9)
    assert measured.lowest_weight == (counts.min() if kind == "samples" else 1.0)


def test_randomized_response_over_messages_is_unbiased_enough(federation):
    """Over the grid (the nodes draw their own noise): noisy per row, but the mean error over
    the rows (independent draws) is within 6 standard errors of 0."""
    dataset, index = federation
    privacy = HeatPrivacy("randomized-response", rr_epsilon=4.0)
    grid = LoopbackGrid(node_handlers(dataset, index, privacy, "clients"))
    report = collect_heat(grid, sorted(grid.handlers), privacy, "clients", dataset.table_rows, 5.0)
    exact = estimate_heat(dataset, index, "clients", HeatPrivacy())
    p = rr.keep_probability(4.0)
    std = np.sqrt(p * (1 - p) * dataset.num_clients) / (2 * p - 1)
    for table, heat in exact.items():
        error = report.measured.heat[table] - heat
        assert np.abs(error).max() > 0  # noise was added on the nodes
        assert abs(error.mean()) < 6 * std / np.sqrt(len(error))
    assert report.measured.num_clients == dataset.num_clients


@pytest.mark.parametrize("kind", ["clients", "samples"])
def test_measured_heat_gives_the_algorithm_the_coefficients_of_the_index_sets(federation, kind):
    """AlgorithmContext with ``measured`` heat (no index sets, no per-client counts) builds
    FedSubAvg with the coefficients and population totals of the exact context."""
    dataset, index = federation
    privacy = HeatPrivacy("secagg", group_size=5)
    grid = LoopbackGrid(node_handlers(dataset, index, privacy, kind))
    report = collect_heat(grid, sorted(grid.handlers), privacy, kind, dataset.table_rows, 5.0)
    exact = AlgorithmContext(dataset, index, kind, 2)
    unknown = ClientSizes(dataset.table_rows, np.ones(dataset.num_clients, dtype=np.int64))
    measured = AlgorithmContext(
        unknown, SubmodelIndex({}, {}), kind, 2, privacy, measured=report.measured
    )
    for name, scheme in (("fedsubavg", ""), ("fedsubavg@scheme2", "scheme2")):
        a = build_algorithm(name, exact, None).aggregation
        b = build_algorithm(name, measured, None).aggregation
        assert (a.population_weight, a.num_clients) == (b.population_weight, b.num_clients)
        assert a.weighting == b.weighting, scheme
    want, got = heat_coefficients(exact), heat_coefficients(measured)
    for table in want:
        np.testing.assert_array_equal(got[table].numpy(), want[table].numpy())


def test_a_node_refuses_groups_that_would_not_hide_its_vector(federation):
    """A server asking for a group of one, a minority threshold, or unmasking with fewer than
    t survivors is refused by the node itself."""
    dataset, index = federation
    privacy = HeatPrivacy("secagg")
    grid = LoopbackGrid(node_handlers(dataset, index, privacy, "clients"))
    node = wide(101)
    handler, context = grid.handlers[node], grid.contexts[node]

    def ask(fields: dict) -> Message:
        return handler(
            Message(RecordDict({"heat": ConfigRecord(fields)}), node, MESSAGE_TYPE), context
        )

    session = b"s" * 16
    keys = heat_fields(ask(records.advertise_request(session, 0, 1, "secagg")).content, "test")
    own = records.decode_advertise(keys, session, "test")
    with pytest.raises(HeatMessageError, match="from another session than this node's"):
        ask(records.share_request(b"o" * 16, [own]))
    with pytest.raises(HeatMessageError, match="unknown heat stage 'sum'"):
        ask({"stage": "sum", "session": session})
    with pytest.raises(HeatMessageError, match="a group of 1 with threshold t = 1"):
        ask(records.share_request(session, [own]))
    peer = AdvertiseKeys(session, 1, own.channel_key, own.mask_key)
    with pytest.raises(HeatMessageError, match="a group of 2 with threshold t = 1"):
        ask(records.share_request(session, [own, peer]))
    ask(records.advertise_request(session, 0, 2, "secagg"))
    ask(records.share_request(session, [own, peer]))
    request = UnmaskRequest(session, (0,), (1,))
    with pytest.raises(HeatMessageError, match="only 1 survivors, fewer than t = 2"):
        ask(records.unmask_request(request))


class AppGrid(AnsweredAtOnce):
    """Nodes ``wide(100 + k)`` (partition k; ids across the unsigned 64-bit range,
    tests/flower_rounds.py) running the real ClientApp in process, each with its node config
    and own Context (a deployment without processes); ``drop`` says which messages' nodes vanish
    before answering: the SuperLink answers for them with Flower's "node unavailable" error,
    as it does once a node's heartbeat stops. A ClientApp's exception comes back as Flower's
    runner replies it (an error with the exception's type and text)."""

    def __init__(self, app, num_nodes: int) -> None:
        self.app = app
        self.contexts = {
            wide(100 + k): Context(
                1, wide(100 + k), {"partition-id": k, "num-partitions": num_nodes}, RecordDict(), {}
            )
            for k in range(num_nodes)
        }
        self.drop: Callable[[int, Message], bool] = lambda node, message: False

    def get_node_ids(self) -> list[int]:
        return sorted(self.contexts)

    def answer(self, messages: Iterable[Message]) -> list[Message]:
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            if self.drop(node, message):
                unavailable = Error(ErrorCode.NODE_UNAVAILABLE, f"node {node} is gone")
                replies.append(Message(unavailable, reply_to=message))
            else:
                try:
                    replies.append(self.app(message, self.contexts[node]))
                except Exception as error:  # as Flower's ClientApp runner replies it
                    reason = str(type(error)) + ":<'" + str(error) + "'>"
                    raised = Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason)
                    replies.append(Message(raised, reply_to=message))
        return replies


EXACT = (
    "data.num_users=4",
    "train.rounds=2",
    "train.clients_per_round=2",
    "train.algorithms=['fedsubavg']",
    "train.heat='samples'",
)


@pytest.mark.parametrize("payload", ["submodel", "full"])
def test_strategy_with_secagg_heat_gives_the_exact_heat_model(payload):
    """The strategy and ClientApp with ``secagg`` heat (both payloads) train the in-process
    exact-heat model; the server learned S(k) of sampled nodes only (by the rows query)."""
    from fedsub.flower.apps import make_client_app
    from fedsub.flower.settings import FlowerSettings

    from .test_flower import in_process_model

    private = (*EXACT, "privacy.heat_source='secagg'", "privacy.secagg_group=2")
    settings = FlowerSettings(overrides=private, payload=payload)
    grid = AppGrid(make_client_app(settings), 4)
    strategy = private_runtime(settings, grid)
    strategy.train(2)
    expected = in_process_model(EXACT)
    for name, value in strategy.params.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5)
    assert strategy.index.rows == {}  # no S(k) from the query round
    cohorts = {k for r in (1, 2) for k in strategy.open().begin(r).cohort.clients.tolist()}
    assert set(strategy.sampled.rows) == cohorts < set(range(4))  # the sampled nodes' only
    assert [r["replies"] for r in strategy.rounds] == [2, 2]


def test_a_node_that_does_not_send_its_rows_is_left_out_of_the_round():
    from flwr.app import MessageType

    from fedsub.flower.apps import make_client_app
    from fedsub.flower.settings import FlowerSettings

    private = (*EXACT, "privacy.heat_source='secagg'", "privacy.secagg_group=2", "train.rounds=1")
    settings = FlowerSettings(overrides=private)
    grid = AppGrid(make_client_app(settings), 4)
    strategy = private_runtime(settings, grid)
    sent = recorded(grid)
    server = strategy.open()  # registration and the heat exchange
    silent = server.begin(1).cohort.clients.tolist()[0]  # partition k is node wide(100 + k)

    def rows_query_to_silent(node: int, message: Message) -> bool:
        query = message.content.get("query")
        rows = isinstance(query, ConfigRecord) and query.get("what") == "rows"
        return rows and node == wide(100 + silent)

    grid.drop = rows_query_to_silent
    strategy.step(1)
    trained = [m for m in sent if m.metadata.message_type == MessageType.TRAIN]
    assert [m.metadata.dst_node_id for m in trained] != [] and wide(100 + silent) not in [
        m.metadata.dst_node_id for m in trained
    ]
    assert strategy.rounds[0]["left_out"] == [silent] and strategy.rounds[0]["updated"]
