"""The randomized-response heat's secret coins (privacy/randomness.py ``HeatCoins``), tested as a
reviewer who reads everything a run publishes (config.toml, hence train.seed) would attack it:
with the coins drawn from the seed the heat estimate decodes back into the exact counts (a
canary client's row membership with it); keyed by the run's secret it reveals only what
randomized response allows. The secret is settled before the heat is computed, kept only in
checkpoints, and a resumed run recomputes the same heat from it."""

from __future__ import annotations

import json
import logging
import math
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedsub import config as config_lib
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm, heat_coefficients
from fedsub.data.federated import ClientSizes
from fedsub.data.ragged import Ragged
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine import loop
from fedsub.engine.loop import Interrupted
from fedsub.errors import ConfigError, FedsubError
from fedsub.numerics import secret_streams
from fedsub.numerics.seeding import Secret
from fedsub.privacy.heat_sources import HeatPrivacy, estimate_heat
from fedsub.privacy.randomness import HEAT_NOT_PRIVATE, HEAT_STAGE, HeatCoins
from fedsub.runs import experiment, run_setup
from fedsub.submodel.index import SubmodelIndex

from .test_distributed import torchrun
from .test_dp_secret import dying_in_round

ROWS = 48


def _federation(members: list[np.ndarray]) -> tuple[ClientSizes, SubmodelIndex]:
    """A population of ``len(members)`` clients, one table "t" of ROWS rows, client k holding
    the rows ``members[k]`` (one sample each)."""
    lengths = np.array([len(m) for m in members], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.concatenate(members).astype(np.int64)
    index = SubmodelIndex({"t": Ragged(values, offsets)}, {})
    return ClientSizes({"t": ROWS}, np.ones(len(members), dtype=np.int64)), index


def _estimate(members: list[np.ndarray], seed: int, coins: HeatCoins | None) -> np.ndarray:
    dataset, index = _federation(members)
    privacy = HeatPrivacy("randomized-response", rr_epsilon=1.0, seed=seed, coins=coins)
    return estimate_heat(dataset, index, "clients", privacy)["t"]


# -- the attack: redraw every client's coins from the published seed -------------------------


def _canary_attack(randomness: str, trials: int = 400) -> tuple[float, int]:
    """A canary audit of the heat estimate. Client 0 holds S or S + {canary} (a fair coin b);
    the adversary knows every client's rows but that one bit, epsilon and train.seed, and sees
    the estimate. It redraws the estimate of both worlds from the seed: a match names b; with
    no match it falls back to the best single-row test (the canary's estimated count over the
    other clients' count + 1/2). Returns its accuracy and how often a redraw matched."""
    others = [np.arange(k, 40, 3) for k in (1, 2)]  # clients 1 and 2: never the canary rows
    held = np.arange(0, 20, 2)
    coins = np.random.default_rng(5)
    correct = matched = 0
    for trial in range(trials):
        canary = 41 + trial % 7  # held by nobody in world 0
        worlds = [[held, *others], [np.sort(np.append(held, canary)), *others]]
        b = int(coins.integers(2))
        seen = _estimate(worlds[b], trial, HeatCoins(randomness, trial))  # type: ignore[arg-type]
        hits = [np.array_equal(seen, _estimate(w, trial, None)) for w in worlds]
        if any(hits):
            matched += 1
            guess = hits.index(True)
        else:
            guess = int(seen[canary] > 0.5)  # the others never hold it
        correct += guess == b
    return correct / trials, matched


def test_seeded_coins_give_the_canary_away_and_secret_ones_only_what_rr_allows():
    accuracy, matched = _canary_attack("seeded")
    assert accuracy == 1.0 and matched == 400  # the seed redraws the very estimate
    # the secret coins are fresh every run: 4,000 trials put the fallback test's accuracy
    # (0.59 written out: P(estimate > 0.5) is 0.36 with the canary, 0.18 without) 5 standard
    # deviations above 0.55 (400 trials left it 1.7 below about 5% of the time)
    trials = 4000
    accuracy, matched = _canary_attack("secret", trials)
    assert matched == 0  # the published seed redraws none of the secret estimates
    bound = math.exp(1.0) / (1 + math.exp(1.0))  # any test's accuracy under epsilon = 1 LDP
    assert accuracy <= bound + 3 * math.sqrt(0.25 / trials)
    assert accuracy >= 0.55  # the fallback test works: the audit can tell a leak from chance


def test_seeded_coins_are_train_seeds_stream_written_out():
    """``privacy.randomness = "seeded"``: the very bits fedsub always drew, one generator
    ``default_rng([seed, 0x5151])`` per table, client by client, a bit kept (truthful) when its
    uniform is under p = e^eps / (1 + e^eps); the estimate (sum - (1 - p) N) / (2p - 1)."""
    members = [np.array([0, 3, 7]), np.array([3, 10, 47]), np.array([], dtype=np.int64)]
    got = _estimate(members, 9, HeatCoins("seeded", 9))
    rng, p = np.random.default_rng([9, 0x5151]), math.e / (1 + math.e)
    total = np.zeros(ROWS)
    for own in members:
        truth = np.isin(np.arange(ROWS), own)
        total += np.where(rng.random(ROWS) < p, truth, ~truth)
    np.testing.assert_allclose(got, (total - (1 - p) * 3) / (2 * p - 1), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(got, _estimate(members, 9, None))  # coins None: the seed's
    secret = _estimate(members, 9, HeatCoins("secret", 9))
    assert not np.array_equal(secret, got)
    assert not np.array_equal(secret, _estimate(members, 9, HeatCoins("secret", 9)))


def test_the_key_is_settled_once_before_the_heat_and_a_restore_only_checks_it():
    coins = HeatCoins("secret", 1)
    key = coins.key  # settled now: a fresh secret
    assert isinstance(key, Secret) and coins.key == key
    with pytest.raises(FedsubError, match="settled once"):
        coins.settle()
    saved = coins.state_tensors()
    coins.load_state_tensors(saved)  # the same secret: nothing to do
    other = HeatCoins("secret", 1)
    other.settle()
    with pytest.raises(FedsubError, match="not the one this run's heat was computed from"):
        other.load_state_tensors(saved)
    with pytest.raises(FedsubError, match="not the one"):
        other.load_absent()
    resumed = HeatCoins("secret", 1)
    resumed.settle([{HEAT_STAGE: saved}, {HEAT_STAGE: saved, "model": {}}])
    assert resumed.key == key
    with pytest.raises(FedsubError, match="disagree"):
        HeatCoins("secret", 1).settle([{HEAT_STAGE: saved}, {"model": {}}])


# -- in a run folder: settled before the algorithms are built, kept in the checkpoints -------

BASE = (
    "data.num_users=40", "train.clients_per_round=8", "train.rounds=4", "eval.every=1",
    "train.algorithms=['fedsubavg', 'fedavg']", "privacy.heat_source='randomized-response'",
    "privacy.rr_epsilon=1.0", "train.checkpoint_every=1",
)  # fmt: skip


def _model(folder: Path, name: str = "fedsubavg") -> bytes:
    return (folder / name / "model.safetensors").read_bytes()


def _stopped_after_round_2(config, folder: Path) -> None:
    stop = {"after": False}

    def on_round(algorithm: str, round_index: int) -> None:
        stop["after"] = algorithm == "fedsubavg" and round_index == 2

    with pytest.raises(Interrupted):
        experiment.compare(config, folder, on_round, stop_requested=lambda: stop["after"])


def test_secret_runs_differ_and_a_seeded_run_is_todays(tmp_path, monkeypatch):
    secret = config_lib.load(None, BASE)
    experiment.compare(secret, tmp_path / "a")
    experiment.compare(secret, tmp_path / "b")
    assert _model(tmp_path / "a") != _model(tmp_path / "b")
    seeded = config_lib.load(None, (*BASE, "privacy.randomness='seeded'"))
    experiment.compare(seeded, tmp_path / "seeded")
    record = json.loads((tmp_path / "seeded" / "heat_source.json").read_text())
    assert record["randomness"] == "seeded" and record["not_private"] == HEAT_NOT_PRIVATE
    record = json.loads((tmp_path / "a" / "heat_source.json").read_text())
    assert record["randomness"] == "secret" and "not_private" not in record
    # today's numbers: the context without coins draws from HeatPrivacy.seed as fedsub did
    context_of = run_setup.algorithm_context

    def without_coins(*args):
        context = context_of(*args)
        privacy = HeatPrivacy(**{**context.privacy.__dict__, "coins": None})
        return AlgorithmContext(**{**context.__dict__, "privacy": privacy, "_coefficients": {}})

    monkeypatch.setattr(run_setup, "algorithm_context", without_coins)
    experiment.compare(seeded, tmp_path / "before")
    assert _model(tmp_path / "seeded") == _model(tmp_path / "before")
    assert _model(tmp_path / "seeded") != _model(tmp_path / "a")


def test_a_resumed_secret_run_recomputes_the_same_heat_bit_for_bit(tmp_path):
    """Stopped after fedsubavg's round 2 and resumed (which draws a fresh secret, then reads the
    checkpoint's back before building the algorithms): the files of the same run
    uninterrupted. The secret is in every checkpoint and in no published file."""
    config, pinned = config_lib.load(None, BASE), Secret.fresh()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(secret_streams, "draw_secret", lambda: pinned)
        experiment.compare(config, tmp_path / "straight")
        _stopped_after_round_2(config, tmp_path / "stopped")
    saved = checkpoint_lib.load(sorted((tmp_path / "stopped/fedsubavg/checkpoints").iterdir())[-1])
    assert bytes(saved.stages[HEAT_STAGE]["secret"].numpy()) == pinned.to_bytes()
    experiment.compare(config, tmp_path / "stopped", resume=True)
    for name in ("fedsubavg", "fedavg"):
        assert _model(tmp_path / "stopped", name) == _model(tmp_path / "straight", name)
    for path in (tmp_path / "stopped").rglob("*"):
        if path.is_file() and "checkpoints" not in path.parts:
            assert pinned.to_bytes() not in path.read_bytes(), path
            assert pinned.to_bytes().hex() not in path.read_bytes().decode("latin-1"), path


def test_an_algorithm_starting_after_a_finished_one_reads_its_secret(tmp_path):
    """fedavg finished, fedsubavg not begun: the resume takes fedavg's secret from its
    checkpoints, so fedsubavg's heat is the one of the run uninterrupted (one release of the
    clients' bits, not a second)."""
    overrides = (*BASE, "train.rounds=2", "train.algorithms=['fedavg', 'fedsubavg']")
    config, pinned = config_lib.load(None, overrides), Secret.fresh()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(secret_streams, "draw_secret", lambda: pinned)
        experiment.compare(config, tmp_path / "straight")
        experiment.compare(config, tmp_path / "stopped")
    begun = tmp_path / "stopped" / "fedsubavg"
    for path in sorted(begun.rglob("*"), reverse=True):  # fedsubavg as if never begun
        path.unlink() if path.is_file() else path.rmdir()
    drawn: list[Secret] = []
    with pytest.MonkeyPatch.context() as patch:  # a fresh draw would give another heat
        patch.setattr(secret_streams, "draw_secret", lambda: drawn.append(Secret.fresh()))
        experiment.compare(config, tmp_path / "stopped", resume=True)
    assert drawn == []
    assert _model(tmp_path / "stopped") == _model(tmp_path / "straight")


def test_a_run_that_dies_before_its_first_checkpoint_resumes_on_the_same_heat(tmp_path):
    """fedsubavg killed in round 3 with no checkpoint due yet (every 10), fedavg not begun: the
    heat's secret was checkpointed before round 1, so the resume draws none and both models are
    the uninterrupted run's (one release of the clients' bits, not a second)."""
    overrides = (*BASE, "train.checkpoint_every=10")
    config, pinned = config_lib.load(None, overrides), Secret.fresh()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(secret_streams, "draw_secret", lambda: pinned)
        experiment.compare(config, tmp_path / "straight")
        patch.setattr(loop, "run_round", dying_in_round(3))
        with pytest.raises(RuntimeError, match="killed"):
            experiment.compare(config, tmp_path / "died")
    assert not (tmp_path / "died" / "fedavg" / "checkpoints").exists()
    drawn: list[Secret] = []
    with pytest.MonkeyPatch.context() as patch:  # a fresh draw would give another heat
        patch.setattr(secret_streams, "draw_secret", lambda: drawn.append(Secret.fresh()))
        experiment.compare(config, tmp_path / "died", resume=True)
    assert drawn == []
    for name in ("fedsubavg", "fedavg"):
        assert _model(tmp_path / "died", name) == _model(tmp_path / "straight", name)


def test_a_checkpoint_written_before_the_secret_resumes_seeded_and_says_so(
    tmp_path, monkeypatch, caplog
):
    """A run folder from a fedsub that drew the heat from the seed (its checkpoints have no
    ``heat_secret`` stage, its config the default secret) continues as it started: seeded,
    which the log and heat_source.json say, and its models are the old fedsub's."""
    context_of = run_setup.algorithm_context

    def old_fedsub(*args):  # what the context was: the coins from HeatPrivacy.seed
        context = context_of(*args)
        privacy = HeatPrivacy(**{**context.privacy.__dict__, "coins": None})
        return AlgorithmContext(**{**context.__dict__, "privacy": privacy, "_coefficients": {}})

    config = config_lib.load(None, BASE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_setup, "algorithm_context", old_fedsub)
        experiment.compare(config, tmp_path / "straight")
        _stopped_after_round_2(config, tmp_path / "old")
    saved = checkpoint_lib.load(sorted((tmp_path / "old/fedsubavg/checkpoints").iterdir())[-1])
    assert HEAT_STAGE not in saved.stages
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        experiment.compare(config, tmp_path / "old", resume=True)
    assert HEAT_NOT_PRIVATE in caplog.text and "has no heat secret" in caplog.text
    for name in ("fedsubavg", "fedavg"):
        assert _model(tmp_path / "old", name) == _model(tmp_path / "straight", name)
    record = json.loads((tmp_path / "old" / "heat_source.json").read_text())
    assert record["randomness"] == "seeded" and record["not_private"] == HEAT_NOT_PRIVATE


def test_an_engine_resume_with_another_secret_is_refused(small_synthetic):
    """The heat cannot be recomputed once the algorithm is built: restoring a checkpoint whose
    secret is not the heat's is an error, never a silent mix."""
    index = SubmodelIndex.build(small_synthetic)
    privacy = HeatPrivacy("randomized-response", coins=HeatCoins("secret", 0))
    context = AlgorithmContext(small_synthetic, index, "clients", 8, privacy)
    algorithm = build_algorithm("fedsubavg", context)
    assert algorithm.heat_coins is privacy.coins and privacy.coins.guaranteed
    heat_coefficients(context)
    another = HeatCoins("secret", 0)
    another.settle()
    with pytest.raises(FedsubError, match="reads it back before the algorithms are built"):
        privacy.coins.load_state_tensors(another.state_tensors())


def test_randomness_is_refused_unless_a_download_or_the_randomized_response_heat_uses_it():
    config_lib.load(
        None, ("privacy.heat_source='randomized-response'", "privacy.randomness='seeded'")
    )
    for overrides in (
        ("privacy.level='heat'", "privacy.randomness='seeded'"),
        ("privacy.heat_source='sketch'", "privacy.randomness='seeded'"),
    ):
        with pytest.raises(ConfigError, match=r"privacy\.randomness.*randomized-response heat"):
            config_lib.load(None, overrides)


# -- torchrun, row-sharded tables: every process draws with process 0's secret -------------

SHARDED = """
[data]
name = "synthetic-sparse"
num_users = 30
num_items = 20
mean_samples_per_user = 6

[model]
name = "embedding-lr"
embedding_dim = 4

[train]
algorithms = ["fedsubavg"]
rounds = 3
clients_per_round = 5
local_steps = 2
batch_size = 4
lr = 0.2
checkpoint_every = 2

[privacy]
heat_source = "randomized-response"
rr_epsilon = 1.0

[execution]
deterministic = true
backend = "sequential"
table_sharding = "rows"
"""


def test_row_sharded_processes_use_process_0s_secret(tmp_path, monkeypatch):
    """Each process computes its rows' heat; with process 0's secret in both, the trained
    model is the one process's model under that secret (a process drawing its own would give
    its rows another heat)."""
    toml = tmp_path / "sharded.toml"
    toml.write_text(SHARDED)
    done = torchrun(tmp_path, "compare", str(toml), "--out", str(tmp_path / "two"), "--quiet")
    assert done.returncode == 0, done.stderr
    checkpoint = tmp_path / "two" / "fedsubavg" / "checkpoints" / "round-000002"
    secrets = [
        load_file(checkpoint / f"shard-{r}-of-2" / f"{HEAT_STAGE}.safetensors")["secret"]
        for r in range(2)
    ]
    assert torch.equal(secrets[0], secrets[1])
    pinned = Secret.from_bytes(bytes(secrets[0].numpy()))
    alone = config_lib.parse(tomllib.loads(SHARDED.replace('"rows"', '"none"')))
    monkeypatch.setattr(secret_streams, "draw_secret", lambda: pinned)
    experiment.compare(alone, tmp_path / "one")
    a = load_file(tmp_path / "two" / "fedsubavg" / "model.safetensors")
    b = load_file(tmp_path / "one" / "fedsubavg" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and the randomized responses did matter: another secret trains another model
    monkeypatch.setattr(secret_streams, "draw_secret", Secret.fresh)
    experiment.compare(alone, tmp_path / "other")
    c = load_file(tmp_path / "other" / "fedsubavg" / "model.safetensors")
    assert any(not torch.equal(a[k], c[k]) for k in a)
