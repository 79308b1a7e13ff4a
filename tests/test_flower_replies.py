"""The ServerApp reads nodes' replies as a node may send anything: a train reply with wrong
row ids, wrong shapes or dtypes, NaN, oversized arrays, another partition's id or another
round's, missing or mistyped records, and a registration answer alike, is left out of its
round with a line naming the node, and never crashes the run (fuzzed with hypothesis over the
runtime and the engine's loop on a stand-in grid, tests/test_flower_membership.py's)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsub.engine.loop import RunControl, run_round
from fedsub.flower.records import PACKED, packed, tensors_of

from .flower_rounds import narrow, wide
from .test_flower_membership import ROWS, StandInGrid, runtime

pytestmark = pytest.mark.usefixtures("flower_task_identity")

GARBLED = 101  # the node whose replies are garbage (partition 1)

NUMBERS = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 2, 3, 1.5, -1, 2**62, math.nan, math.inf]),
)
DTYPES = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64, torch.bool])
VALUES = st.sampled_from([0.0, 1.0, -3.0, 1e30, math.nan, math.inf, -math.inf])


@st.composite
def tensors(draw) -> torch.Tensor:
    """A tensor of any small shape (row counts up to twice the table's) and dtype."""
    shape = draw(st.lists(st.integers(0, 2 * ROWS), min_size=0, max_size=3))
    value = draw(VALUES)
    dtype = draw(DTYPES)
    filled = torch.full(shape, value, dtype=torch.float64)
    if dtype in (torch.int64, torch.bool):
        filled = torch.nan_to_num(filled, nan=0.0, posinf=1.0, neginf=-1.0).clamp(-5, 5)
    return filled.to(dtype)


@st.composite
def arrays(draw) -> ArrayRecord:
    """Deltas of any names, shapes, dtypes and values, packed as fedsub sends them or one
    Array each as Flower does (flower/records.py); now and then bytes that are no array, or a
    packed record that is not one (bytes that are no safetensors file, cut short, another
    stype, other arrays beside it)."""
    names = draw(
        st.lists(
            st.sampled_from(["table.w", "dense.b", "table.other", "rows.w", "w", "table.w.x"]),
            unique=True,
            max_size=3,
        )
    )
    tensors_drawn = {name: draw(tensors()) for name in names}
    if draw(st.booleans()):  # packed: what fedsub's nodes send
        record = packed(tensors_drawn)
        array = record[PACKED]
        spoil = draw(st.sampled_from(["no", "no", "bytes", "cut", "stype", "beside"]))
        if spoil == "bytes":
            array.data = draw(st.binary(max_size=64))
        elif spoil == "cut":
            array.data = array.data[: draw(st.integers(0, max(len(array.data) - 1, 0)))]
        elif spoil == "stype":
            array.stype = draw(st.sampled_from(["numpy.ndarray", "torch.Tensor", ""]))
        elif spoil == "beside":
            record["table.w"] = Array(torch.zeros(3, 1))
        return record
    record = ArrayRecord(tensors_drawn)
    if draw(st.booleans()) and draw(st.booleans()):
        record["table.w"] = Array(
            dtype="float32", shape=(ROWS, 1), stype="numpy.ndarray", data=b"x"
        )
    return record


@st.composite
def garbage(draw) -> dict:
    """What a garbled train reply holds (partition 1 of a 3-node run)."""
    metrics: dict = {}
    if draw(st.booleans()):
        metrics["partition-id"] = draw(st.one_of(st.just(1), NUMBERS))
    if draw(st.booleans()):
        metrics["num-examples"] = draw(st.one_of(st.just(1), NUMBERS))
    content: dict = {}
    kind = draw(st.sampled_from(["metrics", "config", "none"]))
    if kind == "metrics":
        content["metrics"] = MetricRecord(metrics)
    elif kind == "config":
        content["metrics"] = ConfigRecord({k: str(v) for k, v in metrics.items()})
    if draw(st.booleans()) or not content:
        content["arrays"] = draw(arrays())
    return {"content": content, "round": draw(st.sampled_from(["1", "0", "2", "", "1 "]))}


class Garbling(StandInGrid):
    """The stand-in grid, but node ``GARBLED``'s train reply is ``self.garbage``."""

    garbage: dict | None = None

    def reply(self, m: Message) -> Message | None:
        answer = super().reply(m)
        train = m.metadata.message_type == MessageType.TRAIN
        if not train or narrow(m.metadata.dst_node_id) != GARBLED or self.garbage is None:
            return answer
        reply = Message(RecordDict(self.garbage["content"]), reply_to=m)
        reply.metadata.__dict__["_group_id"] = self.garbage["round"]
        return reply


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbage())
def test_a_garbage_train_reply_is_left_out_of_its_round_never_crashes_the_run(bad):
    grid = Garbling({100: 0, GARBLED: 1, 102: 2})
    grid.garbage = bad
    s = runtime(grid, 1)
    server = s.open(RunControl())
    run_round(server, s, 1)
    record = s.rounds[0]
    assert record["clients"] == [0, 1, 2] and record["replies"] in (2, 3)
    assert record["updated"] and bool(torch.isfinite(s.params.tables["w"]).all())
    if record["replies"] == 3:  # read as an update: it was one of the model's shape
        deltas = tensors_of(bad["content"]["arrays"])
        assert deltas["table.w"].shape == (3, 1) and deltas["table.w"].dtype == torch.float32
        assert bad["round"] == "1"
    else:
        assert record["left_out"] == [1]


def train_reply(m: Message, **changed) -> Message:
    """Node ``GARBLED``'s honest reply to ``m`` (rows 1, 2, 3 of table w), ``changed``."""
    fields = {
        "deltas": {"table.w": torch.full((3, 1), 0.1), **changed.pop("deltas", {})},
        "metrics": {"partition-id": 1, "num-examples": 1, **changed.pop("metrics", {})},
    }
    arrays = packed({k: v for k, v in fields["deltas"].items() if v is not None})
    for key, value in changed.pop("packed", {}).items():  # the packed Array's fields
        setattr(arrays[PACKED], key, value)
    reply = Message(
        RecordDict({"arrays": arrays, "metrics": MetricRecord(fields["metrics"])}),
        reply_to=m,
    )
    for key, value in changed.items():
        reply.metadata.__dict__[f"_{key}"] = value
    return reply


@pytest.mark.parametrize(
    ("changed", "line"),
    [
        ({"deltas": {"table.w": torch.full((3, 1), math.nan)}}, "rejected partition 1"),
        ({"deltas": {"table.w": torch.zeros(ROWS, 1)}}, "table delta 'w' is (5, 1)"),
        ({"deltas": {"table.w": torch.zeros(10**6, 1)}}, "is (1000000, 1) torch.float32"),
        ({"deltas": {"table.w": torch.zeros(3, 1, dtype=torch.float64)}}, "expected (3, 1)"),
        ({"deltas": {"table.w": None}}, "missing ['w']"),
        ({"deltas": {"dense.x": torch.zeros(1)}}, "unexpected ['x']"),
        ({"metrics": {"partition-id": 2}}, "from partition 2, sent to partition 1"),
        ({"metrics": {"num-examples": 10**9}}, "num-examples 1000000000, but it registered 1"),
        ({"metrics": {"num-examples": -1}}, "'num-examples' is -1, expected a whole number"),
        ({"group_id": "0"}, "a reply for round '0', not round 1"),
        ({"packed": {"data": b"\x08" + bytes(7) + b"{}"}}, "arrays cannot be read (Safetensor"),
        ({"packed": {"stype": "numpy.ndarray"}}, "packed arrays are 'numpy.ndarray'"),
    ],
)
def test_each_kind_of_garbage_is_named_in_one_line(caplog, changed, line):
    grid = Garbling({100: 0, GARBLED: 1, 102: 2})
    s = runtime(grid, 1)
    server = s.open(RunControl())
    reply = grid.reply

    def replying(m: Message) -> Message | None:
        ours = m.metadata.message_type == MessageType.TRAIN
        if ours and narrow(m.metadata.dst_node_id) == GARBLED:
            return train_reply(m, **dict(changed))
        return reply(m)

    grid.reply = replying  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        run_round(server, s, 1)
    said = [r.getMessage() for r in caplog.records if str(wide(GARBLED)) in r.getMessage()]
    said += [r.getMessage() for r in caplog.records if "rejected partition 1" in r.getMessage()]
    assert any(line in m for m in said), said
    assert s.rounds[0]["replies"] == 2 or "rejected" in line
    assert bool(torch.isfinite(s.params.tables["w"]).all())


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["partition-id", "num-examples"]), NUMBERS),
    st.one_of(st.none(), arrays()),
)
def test_a_garbage_registration_is_left_out_and_the_others_train(metrics, index):
    """A node's answer to the registration question with any partition id, count or rows:
    refused (logged) unless it is a registration of the run's tables, and the run goes on."""

    class GarbledQuery(StandInGrid):
        def reply(self, m: Message) -> Message | None:
            answer = super().reply(m)
            query = m.metadata.message_type == MessageType.QUERY
            if not query or narrow(m.metadata.dst_node_id) != GARBLED:
                return answer
            content = RecordDict({"metrics": MetricRecord(metrics)})
            if index is not None:
                content["index"] = index
            return Message(content, reply_to=m)

    grid = GarbledQuery({100: 0, GARBLED: 1, 102: 2})
    s = runtime(grid, 1, min_nodes=2, node_wait=0.05)
    server = s.open(RunControl())
    run_round(server, s, 1)
    for k, registration in s.membership.registered.items():
        assert k >= 0 and registration.examples >= 0
        for rows in registration.rows.values():
            assert rows.dtype == np.int64 and (
                len(rows) == 0 or 0 <= rows.min() <= rows.max() < ROWS
            )
    assert s.rounds[0]["replies"] >= 2 and bool(torch.isfinite(s.params.tables["w"]).all())


def test_a_garbage_evaluation_reply_leaves_that_node_out_of_the_evaluation(caplog):
    """Federated evaluation sums the nodes' reports: one that is not a report (no metrics
    record, a non-finite sum, histograms of another size) is left out with a line."""
    from fedsub.engine.binned_auc import BINS
    from fedsub.flower.federated_eval import FederatedEvaluation

    good = {"num-examples": 4, "loss-sum": 2.0, "correct": 3}

    def reply(node: int, content: RecordDict) -> Message:
        asked = Message(RecordDict(), node, MessageType.EVALUATE)
        return Message(content, reply_to=asked)

    replies = [
        reply(wide(100), RecordDict({"metrics": MetricRecord(good)})),
        reply(wide(101), RecordDict({"metrics": MetricRecord({**good, "loss-sum": math.nan})})),
        reply(wide(102), RecordDict({"metrics": ConfigRecord({"num-examples": 4})})),
        reply(wide(103), RecordDict({"metrics": MetricRecord({**good, "auc-positives": [1] * 3})})),
        reply(wide(104), RecordDict({"arrays": ArrayRecord()})),
    ]
    assert BINS != 3
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        metrics = FederatedEvaluation().aggregate(1, replies)
    assert metrics["eval_nodes"] == 1.0 and metrics["test_loss"] == 0.5
    left = [r.getMessage() for r in caplog.records if "evaluation on node" in r.getMessage()]
    assert len(left) == 4 and all(str(wide(n)) in " ".join(left) for n in (101, 102, 103, 104))
