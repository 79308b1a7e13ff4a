"""The virtual clock (fedsub/clock): profiles and traces, a client's time, synchronous rounds
under deadline / over-selection / dropouts, FedBuff's server rule and fedsub's staleness-aware
heat (each checked against its formula written out here), determinism and resume."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from fedsub.algorithms.aggregation import Aggregation, weighted_sum
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.clock import hooks
from fedsub.clock.fedbuff import BufferedUpdate, FedBuffClock, concatenated, fedbuff_combine
from fedsub.clock.profiles import Trace, clock_inputs, drawn_profiles, markov_trace, read_trace
from fedsub.clock.settings import (
    Availability,
    Buffered,
    ClockConfig,
    DeviceDistribution,
    SynchronousRounds,
)
from fedsub.clock.synchronous import first_online, kept_members
from fedsub.clock.timing import submodel_bytes, whole_model_bytes, work_seconds
from fedsub.config import Config
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.engine.loop import Interrupted, RunControl
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.errors import ConfigError
from fedsub.masking.schemes import Masking
from fedsub.models.registry import build_model
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.transfer import CohortUpdate

from .test_backends import two_tables_with_dense

OPTIONS = {"init_std": 0.1, "embedding_dim": 3, "widths": [], "scaler": True}


# ---- profiles and traces ----


def test_drawn_profiles_are_lognormal_with_the_stated_median_and_seeded():
    dist = DeviceDistribution(compute_median=20.0, compute_sigma=1.0, upload_sigma=0.0)
    a = drawn_profiles(dist, seed=3, num_clients=20_000)
    b = drawn_profiles(dist, seed=3, num_clients=20_000)
    assert np.array_equal(a.compute, b.compute)
    assert abs(np.median(a.compute) / 20.0 - 1) < 0.05
    assert abs(np.std(np.log(a.compute)) - 1.0) < 0.03
    assert np.all(a.upload == dist.upload_median)  # sigma 0: constant
    assert not np.array_equal(a.compute, drawn_profiles(dist, 4, 20_000).compute)


def test_trace_online_and_next_changes_with_a_period():
    # client 0: online [10, 20) and [30, 40) in a period of 50; client 1: always online
    trace = Trace(
        np.array([[10.0, 20.0, 30.0, 40.0], [0.0, math.inf, math.inf, math.inf]]),
        np.array([50.0, math.inf]),
        np.array([False, False]),
    )
    assert trace.online(5.0).tolist() == [False, True]
    assert trace.online(15.0).tolist() == [True, True]
    assert trace.online(65.0).tolist() == [True, True]  # 65 mod 50 = 15
    assert trace.online_until(0, 15.0) == 20.0
    assert trace.online_until(0, 62.0) == 70.0
    assert trace.next_online(0, 22.0) == 30.0
    assert trace.next_online(0, 45.0) == 60.0  # wraps into the next period
    assert trace.online_until(1, 1e9) == math.inf
    # the first time anyone (or anyone of ``among``) is online
    offline_one = Trace(trace.toggles[:1], trace.period[:1], trace.starts_online[:1])
    assert first_online(offline_one, 22.0) == 30.0
    assert first_online(trace, 22.0) == 22.0 and first_online(trace, 22.0, np.array([0])) == 30.0


def test_markov_trace_is_online_about_its_stationary_share():
    trace = markov_trace(online_mean=100.0, offline_mean=300.0, seed=0, n=4000)
    share = np.mean([trace.online(t).mean() for t in (0.0, 500.0, 2000.0)])
    assert abs(share - 0.25) < 0.03


def test_fedsub_json_csv_and_fedscale_trace_files(tmp_path):
    n = 5
    drawn = drawn_profiles(DeviceDistribution(), 0, n)
    fedsub_json = tmp_path / "t.json"
    fedsub_json.write_text(
        json.dumps(
            {
                "clients": [
                    {"compute": 10, "upload": 5, "online": [[0, 10]], "period": 20},
                    {"compute": 30},
                ]
            }
        )
    )
    profiles, trace = read_trace(fedsub_json, drawn, Trace.always(n))
    assert profiles.compute.tolist() == [10, 30, 10, 30, 10]  # entry k mod M
    assert profiles.download.tolist() == drawn.download.tolist()  # not given: drawn
    assert profiles.upload[0] == 5 and profiles.upload[1] == drawn.upload[1]
    assert trace.online(15.0).tolist() == [False, True, False, True, False]
    csv_file = tmp_path / "t.csv"
    csv_file.write_text("compute,download,upload,memory\n4,100,50,1e9\n")
    profiles, _ = read_trace(csv_file, drawn, Trace.always(n))
    assert profiles.upload.tolist() == [50.0] * n
    fedscale = tmp_path / "fs.json"
    fedscale.write_text(
        json.dumps(
            {
                "device_capacity": {"7": {"computation": 10.0, "communication": 800.0}},
                "behave_trace": {"7": {"active": [5], "inactive": [15], "finish_time": 30}},
            }
        )
    )
    profiles, trace = read_trace(fedscale, drawn, Trace.always(n))
    assert profiles.compute[0] == pytest.approx(1000 / 30)  # 3 * 10 ms per sample
    assert profiles.upload[0] == pytest.approx(100_000.0)  # 800 kbit/s
    assert trace.online(10.0).all() and not trace.online(20.0).any()
    assert trace.online(40.0).all()  # 40 mod 30 = 10


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"clients": [{"upload": 3}]}', "compute speed"),
        ('{"clients": [{"compute": -1}]}', "positive"),
        ('{"clients": [{"compute": 1, "online": [[5, 2]]}]}', "sorted, disjoint"),
        ('{"other": 1}', "expected"),
    ],
)
def test_bad_trace_files_are_refused_naming_the_key(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as error:
        read_trace(path, drawn_profiles(DeviceDistribution(), 0, 2), Trace.always(2))
    assert "clock.trace" in str(error.value)


# ---- a client's time ----


def small_setup():
    dataset = two_tables_with_dense(0)
    index = SubmodelIndex.build(dataset)
    model = build_model("sparse-lr", dataset, OPTIONS)
    return dataset, index, model


def schedule_of(rounds: int = 4, k: int = 4) -> Schedule:
    return Schedule(
        rounds, k, LocalWork(2, 3, ClientStep(lr=0.1)), seed=3,
        execution=Execution(dtype=torch.float64),
    )  # fmt: skip


def test_bytes_and_seconds_follow_the_written_formula():
    dataset, index, model = small_setup()
    params = initial_params(model, schedule_of())
    n = dataset.num_clients
    sub = submodel_bytes(index, params, n)
    whole = whole_model_bytes(params, n)
    for k in range(n):  # an independent count: the rows each client's samples read
        rows_a = {
            i
            for s in range(int(dataset.client_offsets[k]), int(dataset.client_offsets[k + 1]))
            for i in _ids(dataset, "a", s)
        }
        rows_b = {
            i
            for s in range(int(dataset.client_offsets[k]), int(dataset.client_offsets[k + 1]))
            for i in _ids(dataset, "b", s)
        }
        dim_a, dim_b = params.tables["a"].shape[1], params.tables["b"].shape[1]
        dense = sum(v.numel() for v in params.dense.values())
        assert sub[k] == 8 * (len(rows_a) * dim_a + len(rows_b) * dim_b + dense)
    assert whole[0] == 8 * sum(v.numel() for v in [*params.tables.values(),
                                                    *params.dense.values()])  # fmt: skip
    profiles = drawn_profiles(DeviceDistribution(), 0, n)
    clients = np.array([1, 4])
    got = work_seconds(profiles, sub, 6.0, clients)
    for j, k in enumerate(clients):
        expected = sub[k] / profiles.download[k] + 6.0 / profiles.compute[k]
        expected += sub[k] / profiles.upload[k]
        assert got[j] == pytest.approx(expected, rel=1e-15)


def _ids(dataset, table: str, sample: int) -> list[int]:
    field = dataset.train.ids[table]
    return field.values[field.offsets[sample] : field.offsets[sample + 1]].tolist()


# ---- synchronous rounds ----


def test_deadline_over_selection_and_dropouts_keep_the_written_members():
    seconds = np.array([5.0, 1.0, 9.0, 3.0, 2.0])
    offline = np.array([math.inf, math.inf, math.inf, 100.0, 101.5])
    # no rule: everybody, the round ends with the slowest
    kept = kept_members(100.0, seconds, offline, 5, SynchronousRounds())
    assert kept.members == [0, 1, 2] and kept.ends == 109.0 and kept.dropped_offline == 2
    # deadline 6: member 2 is late; a member dropped, so the round lasts the deadline
    kept = kept_members(100.0, seconds, offline, 5, SynchronousRounds(deadline=6.0))
    assert kept.members == [0, 1] and kept.ends == 106.0 and kept.dropped_late == 1
    # over-selection: keep the first 2 to finish (1 then 0), the round ends at the 2nd
    kept = kept_members(100.0, seconds, np.full(5, math.inf), 2, SynchronousRounds(0, 0.5))
    assert kept.members == [1, 4] and kept.ends == 102.0


def test_a_deadline_round_waits_only_when_someone_it_waits_for_dropped():
    seconds = np.array([5.0, 1.0, 9.0, 3.0, 2.0])
    rules = SynchronousRounds(deadline=8.0, over_selection=0.5)
    # over-selection reached K = 3 (1, 4, 3) although member 0 went offline: ends at the 3rd
    offline = np.array([101.0, math.inf, math.inf, math.inf, math.inf])
    kept = kept_members(100.0, seconds, offline, 3, rules)
    assert kept.members == [1, 3, 4] and kept.ends == 103.0 and kept.dropped_late == 1
    # K = 4 not reached (0 offline, 2 late): the server waits out the deadline
    kept = kept_members(100.0, seconds, offline, 4, rules)
    assert kept.members == [1, 3, 4] and kept.ends == 108.0
    # a cohort drawn smaller than K (few online) that kept everybody ends with its last
    kept = kept_members(100.0, seconds[:2], np.full(2, math.inf), 3, rules)
    assert kept.members == [0, 1] and kept.ends == 105.0
    # the boundaries: a member going offline at its finish, or taking the deadline exactly,
    # is kept
    kept = kept_members(100.0, np.array([8.0, 1.0]), np.array([108.0, math.inf]), 2, rules)
    assert kept.members == [0, 1] and kept.ends == 108.0 and kept.dropped_offline == 0


def run_with(clock: ClockConfig | None, name="fedsubavg", control=None, rounds=4, **kw):
    dataset, index, model = small_setup()
    algorithm = build_algorithm(name, AlgorithmContext(dataset, index, "samples"))
    control = control or RunControl()
    wrap = clock and hooks.wrapper(clock)
    history = []
    params = train(model, algorithm, dataset, index, schedule_of(rounds), control=control,
                   on_evaluation=history.append, wrap_runtime=wrap, **kw)  # fmt: skip
    return params, history


def test_clock_off_and_a_clock_that_drops_nobody_leave_every_number_unchanged():
    plain, _ = run_with(None)
    off, _ = run_with(ClockConfig())
    timed, _history = run_with(ClockConfig(mode="synchronous"))
    for key, value in plain.state_dict().items():
        assert torch.equal(off.state_dict()[key], value), key
        assert torch.equal(timed.state_dict()[key], value), key


def test_over_selection_changes_the_model():
    plain, _ = run_with(None)
    clock = ClockConfig(mode="synchronous", synchronous=SynchronousRounds(over_selection=1.0))
    dropped, _ = run_with(clock)
    assert any(not torch.equal(dropped.state_dict()[k], v) for k, v in plain.state_dict().items())


SMALL = {
    "data": {"name": "synthetic-sparse", "num_users": 60, "num_items": 40},
    "train": {"rounds": 4, "clients_per_round": 6},
    "eval": {"every": 2, "target_test_auc": 0.5},
}


@pytest.mark.parametrize("mode", ["synchronous", "fedbuff"])
def test_a_comparison_records_virtual_time_and_time_to_target(mode):
    from fedsub.runs.experiment import compare

    outcome = compare(Config.from_dict({**SMALL, "clock": {"mode": mode}}), None)
    for name, history in outcome.histories.items():
        times = [e.metrics["virtual_time"] for e in history]
        assert times[0] == 0.0 and all(b > a for a, b in itertools.pairwise(times))
        entry = outcome.summary["algorithms"][name]
        reached = next(e for e in history if e.round == entry["rounds_to_target"])
        assert entry["time_to_target"] == reached.metrics["virtual_time"]
    assert "time to target (virtual s)" in outcome.markdown
    plain = compare(Config.from_dict(SMALL), None)
    assert all("time_to_target" not in e for e in plain.summary["algorithms"].values())


def test_virtual_time_reaches_metrics_jsonl_and_the_trackers(tmp_path):
    """The clock's ``virtual_time`` is an evaluation metric: the run folder's metrics.jsonl and
    an after-round hook (runs/tracking.py) both get it, equal to the history's."""
    from fedsub.runs.experiment import compare
    from fedsub.runs.tracking import RunCallback

    seen: dict[str, dict[int, float]] = {}

    class Recorder(RunCallback):
        def after_round(self, run, round_index, metrics):
            if "virtual_time" in metrics:
                seen.setdefault(run.algorithm, {})[round_index] = metrics["virtual_time"]

    config = Config.from_dict({**SMALL, "clock": {"mode": "synchronous"}})
    outcome = compare(config, tmp_path / "run", callbacks=[Recorder()])
    for name, history in outcome.histories.items():
        expected = {e.round: e.metrics["virtual_time"] for e in history}
        assert sorted(expected) == [0, 2, 4] and expected[4] > 0
        lines = (tmp_path / "run" / name / "metrics.jsonl").read_text().splitlines()
        written = {d["round"]: d["virtual_time"] for d in map(json.loads, lines)}
        assert written == expected
        assert seen[name] == expected


# ---- FedBuff ----


def buffer_update(staleness: list[int]) -> BufferedUpdate:
    """Three members over one table of 5 rows (dim 2) and a dense vector."""
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([0, 2, 2, 3, 4, 0, 4])
    owner = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    return BufferedUpdate(
        clients=torch.tensor([3, 5, 8]),
        weights=torch.tensor([2.0, 5.0, 3.0], dtype=torch.float64),
        multiplicity=torch.ones(3, dtype=torch.int64),
        rows={"t": rows},
        row_owner={"t": owner},
        table_deltas={"t": torch.randn(7, 2, generator=g, dtype=torch.float64)},
        dense_deltas={"d": torch.randn(3, 4, generator=g, dtype=torch.float64)},
        staleness=torch.tensor(staleness),
    )


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_fedbuff_step_is_the_papers_staleness_weighted_mean(weighting):
    update = buffer_update([0, 3, 1])
    got = fedbuff_combine(update, Aggregation(weighting), exponent=0.5)
    n = update.weights if weighting == "samples" else torch.ones(3, dtype=torch.float64)
    u = n / n.sum()  # uniform: 1 / B, the paper's Delta_bar / K
    s = [1 / math.sqrt(1 + tau) for tau in (0, 3, 1)]  # s(tau) = 1 / sqrt(1 + tau)
    expected_dense = sum(u[i] * s[i] * update.dense_deltas["d"][i] for i in range(3))
    torch.testing.assert_close(got.dense["d"], expected_dense, rtol=1e-14, atol=0)
    expected = torch.zeros(5, 2, dtype=torch.float64)
    for e in range(7):
        i = int(update.row_owner["t"][e])
        expected[update.rows["t"][e]] += u[i] * s[i] * update.table_deltas["t"][e]
    assert got.tables["t"].rows.tolist() == [0, 2, 3, 4]
    torch.testing.assert_close(got.tables["t"].values, expected[[0, 2, 3, 4]], rtol=1e-14, atol=0)


def test_staleness_aware_heat_is_fedsubs_written_formula():
    update = buffer_update([2, 0, 5])
    coef = torch.tensor([3.0, 1.0, 2.5, 4.0, 1.5], dtype=torch.float64)
    got = fedbuff_combine(update, Aggregation("samples", {"t": coef}), exponent=0.5)
    u = update.weights / update.weights.sum()
    s = torch.tensor([1 / math.sqrt(1 + tau) for tau in (2, 0, 5)], dtype=torch.float64)
    s_bar = float((u * s).sum() / u.sum())
    for position, m in enumerate([0, 2, 3, 4]):
        holders = [int(update.row_owner["t"][e]) for e in range(7) if update.rows["t"][e] == m]
        entries = [e for e in range(7) if update.rows["t"][e] == m]
        big_u = sum(float(u[i]) for i in holders)
        su = sum(float(u[i] * s[i]) for i in holders)
        c = float(coef[m]) * s_bar * big_u / su
        row = sum(u[update.row_owner["t"][e]] * s[update.row_owner["t"][e]]
                  * update.table_deltas["t"][e] for e in entries)  # fmt: skip
        torch.testing.assert_close(got.tables["t"].values[position], c * row, rtol=1e-13, atol=0)


def test_with_no_staleness_fedbuff_is_the_synchronous_aggregate():
    update = buffer_update([0, 0, 0])
    coef = {"t": torch.tensor([3.0, 1.0, 2.5, 4.0, 1.5], dtype=torch.float64)}
    for aggregation in (Aggregation("samples"), Aggregation("samples", coef)):
        got = fedbuff_combine(update, aggregation, exponent=0.5)
        plain = CohortUpdate(**{k: v for k, v in vars(update).items() if k != "staleness"})
        want = weighted_sum(plain, aggregation)
        torch.testing.assert_close(got.tables["t"].values, want.tables["t"].values)
        torch.testing.assert_close(got.dense["d"], want.dense["d"])


def test_concatenated_updates_keep_each_members_rows():
    a, b = buffer_update([0, 0, 0]), buffer_update([1, 1, 1])
    joined = concatenated([a.select([2]), b.select([0, 1])])
    assert joined.clients.tolist() == [8, 3, 5]
    assert joined.row_owner["t"].tolist() == [0, 0, 1, 1, 2, 2, 2]
    assert torch.equal(joined.dense_deltas["d"][1:], b.dense_deltas["d"][:2])


FEDBUFF = ClockConfig(
    mode="fedbuff",
    online=Availability("markov", online_mean=20.0, offline_mean=10.0),
    buffered=Buffered(concurrency=6, buffer_size=3),
)


def test_fedbuff_batches_each_versions_clients_and_is_reproducible(monkeypatch):
    sizes: list[int] = []
    original = FedBuffClock._train_version

    def counting(self, version, params, buffer):
        before = dict(self.state.kept)
        original(self, version, params, buffer)
        if version in self.state.kept and version not in before:
            sizes.append(len(self.state.kept[version][1]))

    monkeypatch.setattr(FedBuffClock, "_train_version", counting)
    first, _ = run_with(FEDBUFF, rounds=6)
    second, _ = run_with(FEDBUFF, rounds=6)
    for key, value in first.state_dict().items():
        assert torch.equal(second.state_dict()[key], value), key
    assert max(sizes) > 1  # the clients of a version trained as one cohort
    plain, _ = run_with(None, rounds=6)
    assert any(not torch.equal(first.state_dict()[k], v) for k, v in plain.state_dict().items())


def test_every_fedbuff_step_combines_its_buffer_by_fedbuffs_rule(monkeypatch):
    """Each server step is ``fedbuff_combine`` of a buffer of B updates (not another
    feature's combine, e.g. the private rounds' in-the-clear aggregation at level none)."""
    buffers: list[list[int]] = []

    def recording(update, aggregation, exponent):
        buffers.append(update.staleness.tolist())
        return fedbuff_combine(update, aggregation=aggregation, exponent=exponent)

    from fedsub.runs.experiment import compare

    monkeypatch.setattr(hooks, "fedbuff_combine", recording)
    clock = {"mode": "fedbuff", "concurrency": 8, "buffer_size": 3}
    compare(Config.from_dict({**SMALL, "clock": clock}), None)  # as `fedsub compare` runs it
    algorithms = len(Config.from_dict(SMALL).train.algorithms)
    assert [len(b) for b in buffers] == [3] * (4 * algorithms)
    assert any(tau > 0 for b in buffers for tau in b)  # stale updates reached the rule


SYNCHRONOUS = ClockConfig(
    mode="synchronous",
    online=Availability("markov", online_mean=20.0, offline_mean=10.0),
    synchronous=SynchronousRounds(deadline=8.0, over_selection=0.5),
)


def test_a_resumed_synchronous_clock_continues_its_time_and_model(tmp_path):
    straight, _ = run_with(SYNCHRONOUS, rounds=6)
    done: list[int] = []
    stop = RunControl(checkpoints=tmp_path, stop_requested=lambda: done[-1] >= 3)
    with pytest.raises(Interrupted) as stopped:
        run_with(SYNCHRONOUS, control=stop, rounds=6, on_round=done.append)
    saved = checkpoint_lib.load(stopped.value.checkpoint)
    assert float(saved.stages[hooks.STAGE]["now"][0]) > 0
    resumed, _ = run_with(SYNCHRONOUS, control=RunControl(resume=saved), rounds=6)
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


@pytest.mark.parametrize("name", ["fedavg", "fedsubavg"])
def test_fedbuff_resumed_between_steps_with_clients_in_flight_is_bit_identical(name, tmp_path):
    straight, _ = run_with(FEDBUFF, name, rounds=6)
    done: list[int] = []
    stop = RunControl(checkpoints=tmp_path, stop_requested=lambda: done[-1] >= 3)
    with pytest.raises(Interrupted) as stopped:
        run_with(FEDBUFF, name, control=stop, rounds=6, on_round=done.append)
    saved = checkpoint_lib.load(stopped.value.checkpoint)
    assert any(k.startswith("kept.") for k in saved.stages[hooks.STAGE])  # updates in flight
    resumed, _ = run_with(FEDBUFF, name, control=RunControl(resume=saved), rounds=6)
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


# ---- config ----


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({"clock": {"mode": "fedbuff"}, "dp": {"mechanism": "gaussian"}}, r"\[dp\]"),
        (
            {"clock": {"mode": "synchronous"}, "dp": {"mechanism": "gaussian"}},
            r"virtual_time is its slowest member's.*narrow down the secret cohort",
        ),
        (
            {"clock": {"mode": "synchronous", "deadline": 5.0}, "privacy": {"level": "heat"}},
            "privacy.level",
        ),
        ({"clock": {"mode": "sometimes"}}, "clock.mode"),
        ({"clock": {"mode": "fedbuff"}, "execution": {"table_placement": "host"}}, "host"),
        ({"clock": {"mode": "synchronous", "deadline": -1.0}}, "clock.deadline"),
        ({"clock": {"speed": 1}}, "unknown key 'speed'"),
        ({"clock": {"deadline": 5.0}}, r"clock\.deadline does nothing here"),
        ({"clock": {"mode": "fedbuff", "over_selection": 0.5}}, "clock.over_selection"),
        ({"clock": {"mode": "synchronous", "buffer_size": 5}}, "clock.buffer_size"),
    ],
)
def test_config_refuses_what_the_clock_cannot_combine_with(sets, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_dict(sets)


def test_clock_inputs_read_the_settings():
    clock = ClockConfig(online=Availability("markov"))
    profiles, trace = clock_inputs(clock, 0, 10)
    assert len(profiles) == 10 and trace.toggles.shape[0] == 10


# ---- masking's capacities from the profiles' memory ----


def test_memory_assignment_deals_the_largest_levels_to_the_most_memory():
    from fedsub.masking.capacity import Capacities

    memory = (5.0, 1.0, 9.0, 3.0, 7.0, 2.0)
    capacities = Capacities((1.0, 0.5, 0.25), (), "memory", memory)
    levels = capacities.of(0, 1, np.arange(6), 6)
    # two clients per level: 9 and 7 get 1.0, 5 and 3 get 0.5, 2 and 1 get 0.25
    assert levels.tolist() == [0.5, 0.25, 1.0, 0.5, 1.0, 0.25]
    assert capacities.of(0, 7, np.arange(6), 6).tolist() == levels.tolist()  # for the run


def test_memory_assignment_reads_the_clock_and_scales_a_members_time():
    from fedsub.runs.run_setup import schedule_of

    raw = {"model": {"name": "mlp"}, "masking": {"scheme": "rolling"}}
    with pytest.raises(ConfigError, match=r"clock\.mode"):
        Config.from_dict({**raw, "masking": {**raw["masking"], "capacity_assignment": "memory"}})
    config = Config.from_dict(
        {**raw, "masking": {"scheme": "rolling", "capacity_assignment": "memory",
                            "capacities": [1.0, 0.5]},
         "clock": {"mode": "synchronous"}}
    )  # fmt: skip
    schedule = schedule_of(config, 10)
    masking = schedule.setting(Masking)
    assert masking is not None
    memory = np.array(masking.capacities.memory)
    drawn = drawn_profiles(config.clock.devices, config.train.seed, 10).memory
    assert memory.tolist() == drawn.tolist()
    work_share = masking.work_share(config.train.seed, 10)
    assert work_share is not None
    share = work_share(1, np.arange(10))
    assert sorted(share.tolist()) == [0.25] * 5 + [1.0] * 5  # beta^2 for channel slices
    assert share[np.argmax(memory)] == 1.0 and share[np.argmin(memory)] == 0.25


def test_flower_refuses_the_synchronous_clock_with_the_reason():
    """Synchronous rounds on the virtual clock are in-process only; FedBuff runs on Flower in
    real time (tests/test_flower_fedbuff.py)."""
    from fedsub.flower.settings import FlowerSettings

    settings = FlowerSettings(overrides=("clock.mode=synchronous",))
    with pytest.raises(ConfigError, match="in-process only"):
        settings.fedsub_config()
    assert FlowerSettings(overrides=("clock.mode=off",)).fedsub_config().clock.mode == "off"


def test_a_sweep_reports_each_values_time_to_target(tmp_path):
    from fedsub.runs.experiment import sweep

    base = {**SMALL, "train": {**SMALL["train"], "algorithms": ["fedsubavg"]}}
    outcome = sweep("clock.mode", ["synchronous", "fedbuff"], base, tmp_path / "s")
    times = outcome.summary["time_to_target"]["fedsubavg"]
    for value in ("synchronous", "fedbuff"):
        folder = tmp_path / "s" / f"clock.mode={value}"
        summary = json.loads((folder / "summary.json").read_text())
        assert times[value] == summary["algorithms"]["fedsubavg"]["time_to_target"] is not None
        assert (folder / "curves_time.png").exists()


def test_the_synchronous_clock_scales_by_the_share_counts_dropouts_and_waits_for_the_online():
    """``SynchronousClock`` around a runtime that records what it is asked: a masked member's
    time is its work times its share (the slowest kept member ends the round), dropouts are
    counted by kind across rounds, and with nobody of ``among`` online the clock waits for the
    first of them."""
    from fedsub.algorithms.sampling import Cohort
    from fedsub.client.work import CohortWork
    from fedsub.clock.profiles import Profiles
    from fedsub.clock.synchronous import SynchronousClock
    from fedsub.engine.schedule import RoundPlan

    class Recorder:
        def __init__(self) -> None:
            self.plans: list[RoundPlan] = []

        def available(self, round_index, rounds):
            return None

        def run_cohort(self, plan, params):
            self.plans.append(plan)
            return plan

    ones = np.ones(3)
    profiles = Profiles(compute=np.array([10.0, 20.0, 5.0]), download=ones * 100,
                        upload=ones * 100, memory=ones)  # fmt: skip
    # client 2 is offline from t = 3 on; clients 0 and 1 always online
    trace = Trace(
        np.array([[math.inf] * 2, [math.inf] * 2, [3.0, math.inf]]),
        np.full(3, math.inf),
        np.array([True, True, True]),
    )
    exchanged = np.full(3, 50.0)  # 0.5 s down + 0.5 s up each
    inner = Recorder()

    def share(round_index: int, clients: np.ndarray) -> np.ndarray:
        return np.array([0.25, 1.0, 1.0])[clients]  # client 0 holds a quarter of the model

    clock = SynchronousClock(
        inner, profiles, trace, exchanged, 20.0, SynchronousRounds(), 3, share=share
    )
    work = CohortWork(chain=None, lr=np.ones(3))  # type: ignore[arg-type]
    plan = RoundPlan(1, Cohort(np.array([0, 1, 2]), np.ones(3, dtype=np.int64)), work)
    clock.run_cohort(plan, {})  # type: ignore[arg-type]
    # t_k = (1 + 20 / compute_k) * share_k: 0 -> 0.75, 1 -> 2.0, 2 -> 5.0 but offline at 3
    assert clock.time.now == 2.0 and clock.dropped == [1, 0]
    assert inner.plans[-1].cohort.clients.tolist() == [0, 1]
    clock.run_cohort(RoundPlan(2, Cohort(np.array([2]), np.ones(1, dtype=np.int64)), work), {})  # type: ignore[arg-type]
    assert clock.dropped == [2, 0]  # offline again: counted across rounds
    # client 2 only, offline now (t = 2 -> after the failed round): the clock waits for it
    late = Trace(np.array([[math.inf] * 2, [math.inf] * 2, [50.0, math.inf]]),
                 np.full(3, math.inf), np.array([True, True, False]))  # fmt: skip
    waiting = SynchronousClock(Recorder(), profiles, late, exchanged, 20.0, SynchronousRounds(), 3)
    waiting.inner.available = lambda r, rounds: np.array([2])  # type: ignore[method-assign]
    assert waiting.available(1, None).tolist() == [2]  # type: ignore[arg-type]
    assert waiting.time.now == 50.0
    assert waiting.available(2, None).tolist() == [2]  # type: ignore[arg-type]
