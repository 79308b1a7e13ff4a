"""The Flower runtime's elastic membership, checkpoints and resume, on a stand-in Grid (no
processes), driven by the engine's round loop: nodes register as they come online, a
replacement takes its partition over, a node that does not answer is left out, new clients
wait for the next heat refresh, and a run resumed from a checkpoint ends with the
uninterrupted run's model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedsub.dp.settings import DpSettings
from fedsub.engine.loop import Progress, RunControl, drive, run_round
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.engine.server_round import ServerRound
from fedsub.errors import FedsubError
from fedsub.files.run_folder import RunIdentity, hash_config
from fedsub.flower.apps import RUN_ID, latest
from fedsub.flower.records import deltas_record, read_submodel, record_of
from fedsub.flower.server_runtime import FlowerRuntime, Served
from fedsub.flower.settings import FlowerSettings, Nodes, Replies
from fedsub.submodel.params import Params

from .flower_rounds import narrow, wide

ROWS = 5
# partition -> (its rows S(k) of table w, its sample count)
DATA = {0: ([0, 1], 3), 1: ([1, 2, 3], 1), 2: ([3, 4], 2), 3: ([0, 4], 5)}


pytestmark = pytest.mark.usefixtures("flower_task_identity")


@dataclass
class StandInGrid:
    """Flower's Grid for the strategy: ``online`` node name -> partition; a node in ``silent``
    never answers (as a killed node until the round times out). A node trains by moving each
    of its rows 10% of the way towards its partition id. The runtime sees node ``n`` under
    the id ``wide(n)`` (ids across the unsigned 64-bit range, tests/flower_rounds.py); the
    test and the grid's fields name nodes by ``n``."""

    online: dict[int, int]
    silent: set[int] = field(default_factory=set)
    sent: list[list[Message]] = field(default_factory=list)
    fail_on_round: int = 0  # raise when that round's training is sent (a ServerApp crash)
    queued: list[Message | None] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)  # every message pushed, in order
    asked: list[int] = field(default_factory=list)  # nodes that answered a query

    def get_node_ids(self) -> list[int]:
        return sorted(wide(n) for n in self.online)

    def push_messages(self, messages) -> list[str]:
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = str(len(self.queued))  # as Flower's grids do
            ids.append(m.metadata.message_id)
            self.queued.append(m)
            self.messages.append(m)
        return ids

    def pull_messages(self, ids) -> list[Message]:
        """Replies to the messages ``ids`` whose node is online and answers (once each)."""
        replies = []
        for i in ids:
            m = self.queued[int(i)]
            if m is not None and (reply := self.reply(m)) is not None:
                replies.append(reply)
                self.queued[int(i)] = None
        return replies

    def send_and_receive(self, messages, timeout=None):
        messages = list(messages)
        self.sent.append(messages)
        return self.pull_messages(self.push_messages(messages))

    def reply(self, m: Message) -> Message | None:
        node = narrow(m.metadata.dst_node_id)
        if node not in self.online or node in self.silent:
            return None
        k = self.online[node]
        rows, examples = DATA[k]
        metrics = MetricRecord({"partition-id": k, "num-examples": examples})
        if m.metadata.message_type == MessageType.QUERY:
            self.asked.append(node)
            index = ArrayRecord({"rows.w": torch.tensor(rows, dtype=torch.int64)})
            return Message(RecordDict({"index": index, "metrics": metrics}), reply_to=m)
        if int(record_of(m.content, "config", ConfigRecord)["round"]) == self.fail_on_round:
            raise RuntimeError("the ServerApp crashed")
        _, submodel = read_submodel(record_of(m.content, "arrays", ArrayRecord))
        delta = 0.1 * (k - submodel.tables["w"])
        content = RecordDict({"arrays": deltas_record({"w": delta}, {}), "metrics": metrics})
        return Message(content, reply_to=m)


def runtime(grid: StandInGrid, rounds: int = 8, **kw) -> FlowerRuntime:
    """The Flower runtime of a FedSubAvg run (or ``algorithm``) over ``grid``; ``kw``: its
    run config settings (min_nodes 1, node_wait 1 s, a silent node given up after 0.3 s,
    unless given)."""
    options = {"min_nodes": 1, "node_wait": 1.0, "round_timeout": 0.3, **kw}
    name = options.pop("algorithm", "fedsubavg")
    groups = {
        g: {k: options.pop(k) for k in list(options) if k in _fields(g)} for g in (Nodes, Replies)
    }
    return FlowerRuntime(
        grid,  # type: ignore[arg-type]
        Params({"w": torch.zeros(ROWS, 1)}, {}),
        Served(name, None, "clients"),
        Schedule(rounds, 3, LocalWork(1, 1, ClientStep(0.5)), seed=0),
        FlowerSettings(nodes=Nodes(**groups[Nodes]), replies=Replies(**groups[Replies])),
    )


def _fields(group: type) -> set[str]:
    return {f.name for f in dataclasses.fields(group)}


@dataclass
class Stepped:
    """A Flower runtime and the loop's server round, one round at a time (as
    ``engine.loop.drive`` runs them)."""

    runtime: FlowerRuntime
    server: ServerRound | None = None

    def __getattr__(self, name: str):  # its records, membership, params: the runtime's
        return getattr(self.runtime, name)


def strategy(grid: StandInGrid, **kw) -> Stepped:
    return Stepped(runtime(grid, **kw))


def train_round(s: Stepped, grid: StandInGrid, r: int) -> list[int]:
    """One round; the nodes it was sent to."""
    if s.server is None:
        s.server = s.runtime.open(RunControl())
    before = len(grid.queued)
    run_round(s.server, s.runtime, r)
    return [
        narrow(m.metadata.dst_node_id)
        for m in grid.messages[before:]
        if m.metadata.message_type == MessageType.TRAIN
    ]


def start(s: FlowerRuntime, control: RunControl | None = None) -> Progress:
    """The whole run, as the ServerApp runs it."""
    control = control or RunControl()
    return drive(s.open(control), s, s.schedule, control)


def test_a_replacement_takes_its_partition_over_and_a_silent_node_costs_one_round():
    grid = StandInGrid({100: 0, 101: 1, 102: 2})
    s = strategy(grid)
    assert train_round(s, grid, 1) == [100, 101, 102]
    grid.silent.add(102)  # killed: it never answers
    assert train_round(s, grid, 2) == [100, 101, 102]
    assert s.rounds[-1]["left_out"] == [2] and s.rounds[-1]["updated"]
    grid.online[300] = 3
    grid.silent.add(300)  # online but never answers its registration query: not waited for
    assert train_round(s, grid, 3) == [100, 101]  # 102 left out, though Flower still lists it
    grid.online[202] = 2  # the replacement: same partition, new node
    assert train_round(s, grid, 4) == [100, 101, 202]
    assert s.rounds[-1]["clients"] == [0, 1, 2] and s.rounds[-1]["replies"] == 3
    assert sorted(grid.asked) == [100, 101, 102, 202]  # only new nodes are asked, once
    assert 3 not in s.membership.registered
    assert s.membership.counted == [0, 1, 2]  # same data: no new population


def test_a_new_client_is_sampled_once_the_heat_coefficients_count_it():
    grid = StandInGrid({100: 0, 101: 1})
    s = strategy(grid, heat_refresh_every=2)
    train_round(s, grid, 1)
    grid.online[103] = 3
    assert train_round(s, grid, 2) == [100, 101]  # registered, not yet in the coefficients
    assert 3 in s.membership.registered and s.membership.counted == [0, 1]
    assert train_round(s, grid, 3) == [100, 101, 103]  # round 3 = 1 + R: refreshed
    # FedSubAvg's coefficient of row m is N / n_m over the registered clients (heat "clients")
    held = [DATA[k][0] for k in (0, 1, 3)]
    heat = np.array([sum(m in rows for rows in held) for m in range(ROWS)])
    assert s.server is not None
    coefficients = s.server.algorithm.aggregation.coefficients["w"].flatten().numpy()
    np.testing.assert_allclose(coefficients, 3 / heat, rtol=1e-6)
    np.testing.assert_array_equal(s.server.counts, [3, 1, 5])


def test_round_1_refuses_to_start_without_min_nodes():
    missing = (
        r"1 node\(s\) registered .*min-nodes = 2; partition\(s\) missing: \[1\] "
        r"\(registered: \[0\]\)"
    )
    with pytest.raises(FedsubError, match=missing):
        grid = StandInGrid({100: 0})
        train_round(strategy(grid, min_nodes=2, node_wait=0.3), grid, 1)


def stamp(description: str) -> RunIdentity:
    """A Flower run's checkpoint stamp: its config hash alone."""
    return RunIdentity(RUN_ID, hash_config(description))


def run(tmp_path, grid: StandInGrid, resume: bool = False) -> FlowerRuntime:
    control = RunControl(tmp_path / "checkpoints", 1, run=stamp("a").as_json())
    if resume:
        control.resume = latest(tmp_path / "checkpoints", stamp("a"))
    s = runtime(grid, 5, algorithm="fedsubavg-adam", round_timeout=1.0)
    start(s, control)
    return s


def test_a_run_resumed_from_its_checkpoint_ends_with_the_uninterrupted_runs_model(tmp_path):
    nodes = {100: 0, 101: 1, 102: 2, 2**64 - 7: 3}  # Flower's node ids are unsigned 64-bit
    whole = run(tmp_path / "whole", StandInGrid(dict(nodes)))
    assert float(whole.params.tables["w"].abs().sum()) > 0
    with pytest.raises(RuntimeError, match="crashed"):
        run(tmp_path / "cut", StandInGrid(dict(nodes), fail_on_round=4))
    resumed = run(tmp_path / "cut", StandInGrid(dict(nodes)), resume=True)
    # the server's Adam state came back too: otherwise rounds 4-5 would move differently
    torch.testing.assert_close(resumed.params.tables["w"], whole.params.tables["w"], rtol=0, atol=0)
    assert [r["round"] for r in resumed.rounds] == [1, 2, 3, 4, 5]
    assert resumed.membership.counted == [0, 1, 2, 3]
    assert resumed.membership.node_of(3) == wide(2**64 - 7)


def test_resume_refuses_another_configurations_checkpoint_and_a_missing_one(tmp_path):
    run(tmp_path, StandInGrid({100: 0, 101: 1}))
    with pytest.raises(FedsubError, match=r"written by another configuration.*overwrite = true"):
        latest(tmp_path / "checkpoints", stamp("b"))
    with pytest.raises(FedsubError, match="holds no checkpoint"):
        latest(tmp_path / "none", stamp("a"))


def test_a_node_that_missed_a_round_is_sampled_again_once_it_answers():
    grid = StandInGrid({100: 0, 101: 1, 102: 2})
    s = strategy(grid)
    train_round(s, grid, 1)
    grid.silent.add(101)  # slow: misses round 2, and the question sent after it
    train_round(s, grid, 2)
    assert train_round(s, grid, 3) == [100, 102]
    grid.silent.discard(101)  # its answer to that question arrives
    assert train_round(s, grid, 4) == [100, 101, 102]
    assert s.rounds[-1]["replies"] == 3


class KilledAndReplacedInRound2(StandInGrid):
    """Node 102 (partition 2) dies as round 2's training is pulled, and its replacement 202
    comes online then; ``pushed`` logs each query's node with the rounds the runtime had
    finished when it was sent."""

    def __init__(self, online: dict[int, int]) -> None:
        super().__init__(online)
        self.watched: FlowerRuntime | None = None
        self.pushed: list[tuple[int, int]] = []

    def push_messages(self, messages) -> list[str]:
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == MessageType.QUERY and self.watched is not None:
                self.pushed.append((narrow(m.metadata.dst_node_id), len(self.watched.rounds)))
        return super().push_messages(messages)

    def pull_messages(self, ids) -> list[Message]:
        if any((m := self.queued[int(i)]) is not None and m.metadata.group_id == "2" for i in ids):
            self.silent.add(102)
            self.online[202] = 2
        return super().pull_messages(ids)


def test_a_replacement_that_comes_online_while_a_round_waits_ends_the_wait_and_is_sampled_next(
    monkeypatch,
):
    """Node 102 dies in round 2, its replacement 202 comes online: asked and registered while
    round 2 waits, it ends the wait for 102 (not the 600 s round timeout; a fake clock) and
    trains from round 3 on."""
    from fedsub.flower import exchange as exchange_lib

    from .test_flower_exchange import Clock

    clock = Clock()
    monkeypatch.setattr(exchange_lib.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(exchange_lib.time, "sleep", clock.sleep)
    grid = KilledAndReplacedInRound2({100: 0, 101: 1, 102: 2})
    s = runtime(grid, 3, round_timeout=600.0)
    grid.watched = s
    start(s)
    assert (202, 1) in grid.pushed  # asked while round 2 waited for node 102
    assert s.rounds[1]["left_out"] == [2] and s.rounds[1]["replies"] == 2
    assert clock.now < 10.0  # the run never waited out a round timeout
    assert s.rounds[2]["nodes"] == [wide(100), wide(101), wide(202)] and s.rounds[2]["replies"] == 3


def test_settings_of_membership_and_checkpoints_are_read_and_checked():
    from fedsub.errors import ConfigError

    settings = FlowerSettings.from_run_config(
        {
            "min-nodes": 2,
            "node-wait": 5.0,
            "heat-refresh-every": 3,
            "checkpoint-every": 2,
            "resume": "true",
            "out-dir": "/tmp/fedsub-flower-test",
        }
    )
    assert settings.nodes == Nodes(min_nodes=2, node_wait=5.0, heat_refresh_every=3)
    assert settings.output.checkpoint_every == 2 and settings.output.resume is True
    for bad, message in (
        ({"heat-refresh-every": 0}, "heat-refresh-every = 0 is out of range; expected >= 1"),
        ({"min-nodes": -1}, "min-nodes = -1 is out of range; expected >= 0"),
        ({"node-wait": 0}, "node-wait = 0.0 is out of range; expected > 0"),
        ({"checkpoint-every": 1}, "checkpoint-every needs out-dir"),
        ({"resume": True}, "resume needs out-dir"),
        ({"resume": "yes", "out-dir": "/tmp/x"}, "resume must be true or false, got 'yes'"),
    ):
        with pytest.raises(ConfigError, match=message):
            FlowerSettings.from_run_config(bad)


def test_a_round_with_no_node_available_fails_without_sampling_anyone():
    """Scheme I (proportional sampling) over nobody: an empty round, counted as failed."""
    grid = StandInGrid({100: 0, 101: 1})
    s = strategy(grid, algorithm="fedavg@scheme1", max_failed_rounds=5)
    train_round(s, grid, 1)
    grid.silent.update({100, 101})
    train_round(s, grid, 2)
    assert train_round(s, grid, 3) == []
    assert s.rounds[-1]["sampled"] == 0 and "fewer than min-replies" in s.rounds[-1]["failed"]


def test_train_messages_and_replies_follow_flowers_conventions():
    """``arrays`` + ``config`` in every train message, ``arrays`` + ``metrics`` with
    ``num-examples`` in the replies (as flwr's FedAvg expects); the run trains."""
    grid = StandInGrid({100: 0, 101: 1, 102: 2})
    s = runtime(grid, 2)
    start(s)
    train = [m for m in grid.messages if m.metadata.message_type == MessageType.TRAIN]
    assert len(train) == 6
    assert all(set(m.content.keys()) == {"arrays", "config"} for m in train)
    assert [r["replies"] for r in s.rounds] == [3, 3]
    assert float(s.params.tables["w"].abs().sum()) > 0


class LikeTheSuperLink(StandInGrid):
    """A node in ``gone`` was removed from the federation: every pull of a message to it
    gets the SuperLink's own error (sender id 1, "Message Unavailable"), again at each pull,
    as Flower's SuperLink answers. ``events`` run when a round's training is first pulled:
    round -> what happens then (a node dies, a replacement or a new client comes online)."""

    def __init__(self, online: dict[int, int]) -> None:
        super().__init__(online)
        self.gone: set[int] = set()
        self.events: dict[str, Callable[[], None]] = {}

    def pull_messages(self, ids) -> list[Message]:
        from flwr.app import Error
        from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

        for i in ids:
            m = self.queued[int(i)]
            train = m is not None and m.metadata.message_type == MessageType.TRAIN
            if train and (event := self.events.pop(m.metadata.group_id, None)) is not None:
                event()
        replies = super().pull_messages(ids)
        for i in ids:
            m = self.queued[int(i)]
            if m is not None and narrow(m.metadata.dst_node_id) in self.gone:
                reply = Message(
                    Error(ErrorCode.MESSAGE_UNAVAILABLE, "Error: Message ..."), reply_to=m
                )
                reply.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
                replies.append(reply)
        return replies


def test_membership_changes_are_logged_once_each_naming_the_node_and_the_round(monkeypatch, caplog):
    """Node 102 misses round 2 and is asked again; it dies with that question pending (the
    SuperLink answers for it at every pull, sender id 1): one line names node 102 and the
    SuperLink, never "node 1", and no line repeats. Its replacement 202 and a new client 300
    come online while round 3 waits: one line each, with the round from which they count."""
    import logging

    from fedsub.flower import exchange as exchange_lib

    from .test_flower_exchange import Clock

    clock = Clock()
    monkeypatch.setattr(exchange_lib.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(exchange_lib.time, "sleep", clock.sleep)
    grid = LikeTheSuperLink({100: 0, 101: 1, 102: 2})

    def dies() -> None:  # 102's question (asked at round 3) stays pending: it died
        grid.gone.add(102)
        grid.online.pop(102)
        grid.silent.add(101)  # round 3 waits its whole timeout, pulling every 0.2 s
        grid.online.update({202: 2, 300: 3})

    grid.events = {"2": lambda: grid.silent.add(102), "3": dies}
    s = runtime(grid, 5, round_timeout=30.0)
    with caplog.at_level(logging.INFO, logger="fedsub"), caplog.at_level(logging.INFO, "flwr"):
        start(s)
    # fedsub's warnings and the lines it logs through Flower's logger (the round lines too)
    lines = [
        r.getMessage().removeprefix("fedsub: ")
        for r in caplog.records
        if r.name == "fedsub" or r.getMessage().startswith("fedsub: ")
    ]
    assert clock.now > 30  # round 3 waited: 150 pulls of the dead node's question
    assert not any("node 1 " in line or "node 1:" in line for line in lines)
    about_102 = [line for line in lines if f"node {wide(102)}" in line]
    assert about_102 == [
        f"node {wide(102)} registered partition 2",
        f"round 2: no update from node {wide(102)} (partition 2): left out until it answers",
        f"registration: node {wide(102)} failed: the SuperLink: message unavailable (the node "
        "left, or it expired)",
        f"node {wide(102)} (partition 2) went offline before round 4: not sampled while it is away",
        f"partition 2: node {wide(202)} takes over from node {wide(102)}, sampled from round 4",
    ]
    assert (
        f"node {wide(300)} registered partition 3, a new client: counted and sampled from "
        "round 4 (heat-refresh-every = 1)" in lines
    )
    assert f"node {wide(100)} registered partition 0" in lines
    assert len(lines) == len(set(lines)) + sum(  # nothing repeats but the left-out rounds
        lines.count(x) - 1 for x in set(lines) if "left out" in x or "answered again" in x
    )
    assert s.rounds[3]["nodes"] == [wide(100), wide(202), wide(300)]


def test_a_secret_dp_run_resumed_after_a_crash_ends_with_the_uninterrupted_model(tmp_path):
    """[dp] with secret randomness on Flower: the ServerApp crashed in round 4 and resumed
    reads its secret back from the checkpoint (the resumed process draws another, which must
    not be used) and ends with the model and every round's epsilon of the uninterrupted run
    that drew the same secret; a run with another secret ends elsewhere."""
    from fedsub.dp.settings import NoiseKey
    from fedsub.numerics import secret_streams
    from fedsub.numerics.seeding import Secret

    from .test_dp import settings as dp_settings

    accounting = dataclasses.replace(
        dp_settings().accounting, num_clients=4, clients_per_round=3, rounds=5, delta=1e-3
    )
    dp = dp_settings(
        clip=0.5, noise_multiplier=0.5, rows="all", accounting=accounting, key=NoiseKey("secret")
    )

    def dp_run(folder, grid: StandInGrid, secret: Secret, resume: bool = False) -> FlowerRuntime:
        control = RunControl(folder / "checkpoints", 1, run=stamp("dp").as_json())
        if resume:
            control.resume = latest(folder / "checkpoints", stamp("dp"))
        s = runtime(grid, 5, algorithm="fedavg", round_timeout=1.0)
        s.schedule = s.schedule.with_setting(DpSettings, dp)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(secret_streams, "draw_secret", lambda: secret)
            start(s, control)
        return s

    nodes = {100: 0, 101: 1, 102: 2, 2**64 - 7: 3}
    pinned = Secret.fresh()
    whole = dp_run(tmp_path / "whole", StandInGrid(dict(nodes)), pinned)
    with pytest.raises(RuntimeError, match="crashed"):
        dp_run(tmp_path / "cut", StandInGrid(dict(nodes), fail_on_round=4), pinned)
    resumed = dp_run(tmp_path / "cut", StandInGrid(dict(nodes)), Secret.fresh(), resume=True)
    torch.testing.assert_close(resumed.params.tables["w"], whole.params.tables["w"], rtol=0, atol=0)
    assert [r["epsilon"] for r in resumed.rounds] == [r["epsilon"] for r in whole.rounds]
    assert [r["clients"] for r in resumed.rounds] == [r["clients"] for r in whole.rounds]
    other = dp_run(tmp_path / "other", StandInGrid(dict(nodes)), Secret.fresh())
    assert not torch.equal(other.params.tables["w"], whole.params.tables["w"])
