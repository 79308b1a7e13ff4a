"""The privacy levels' secret randomness (fedsub/privacy/randomness.py), tested as a reviewer
who reads everything a run publishes (config.toml, hence train.seed) would attack it: a private
download request whose coins are drawn from the seed gives the client's rows away; drawn from
the clients' secret it hides them as randomized response says; the secret is kept only in
checkpoints (in process) or the node's own run state (Flower), and a resumed run continues its
streams bit for bit."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message

from fedsub import config as config_lib
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.loop import Interrupted, RunControl
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.errors import ConfigError
from fedsub.models.registry import build_model
from fedsub.numerics import secret_streams
from fedsub.numerics.seeding import Secret
from fedsub.privacy import levels
from fedsub.privacy.download_protocol import SECRET
from fedsub.privacy.levels import Privacy
from fedsub.privacy.private_rounds import PrivateRounds
from fedsub.privacy.randomness import NOT_PRIVATE, STAGE
from fedsub.privacy.requests import client_request
from fedsub.runs import experiment
from fedsub.submodel.index import SubmodelIndex

from .equivalence import algorithm_for

CLIENTS = 8
TABLE = 400


# -- the attack: redraw the coins from the published seed --------------------------------------


def _attack_accuracy(randomness: str, trials: int = 600) -> tuple[float, int]:
    """A canary audit of one client's request. The client holds S or S + {canary} (a fair coin
    b); the adversary knows S, the canary, the privacy settings and train.seed, and sees the
    request. It redraws the request of both worlds from the seed: a match names b; with no
    match it falls back to the best guess randomized response allows (the canary requested:
    held). Returns its accuracy and how often a redraw matched."""
    privacy = Privacy("download", download_epsilon=1.0, download_keep=0.6, randomness="seeded")
    seed, held = 7, np.arange(0, 40, 2, dtype=np.int64)
    coins = np.random.default_rng(11)
    correct = matched = 0
    for trial in range(trials):
        canary = 41 + trial % 300  # never in ``held``
        worlds = [held, np.sort(np.append(held, canary))]
        b = int(coins.integers(2))
        key = seed if randomness == "seeded" else Secret.fresh()
        seen = client_request(privacy, {"t": worlds[b]}, {"t": TABLE}, key, 3, trial)["t"]
        redrawn = [
            client_request(privacy, {"t": w}, {"t": TABLE}, seed, 3, trial)["t"] for w in worlds
        ]
        hits = [np.array_equal(seen, r) for r in redrawn]
        if any(hits):
            matched += 1
            guess = hits.index(True)
        else:
            guess = int(canary in seen)
        correct += guess == b
    return correct / trials, matched


def test_seeded_requests_give_every_canary_away_and_secret_ones_only_what_rr_allows():
    accuracy, matched = _attack_accuracy("seeded")
    assert accuracy == 1.0 and matched == 600  # the seed redraws the very request
    trials = 3000  # fresh secret coins every run: the fallback's 0.61 stays 7 deviations over 0.55
    accuracy, matched = _attack_accuracy("secret", trials)
    assert matched == 0  # the published seed redraws none of the secret requests
    bound = math.exp(1.0) / (1 + math.exp(1.0))  # any test's accuracy under epsilon = 1 LDP
    assert accuracy <= bound + 3 * math.sqrt(0.25 / trials)
    assert accuracy >= 0.55  # the fallback guess works: the test can tell a leak from chance


# -- in process: the run's secret, kept in checkpoints -----------------------------------------


def _schedule(dataset, randomness: str, rounds: int = 4) -> tuple:
    index = SubmodelIndex.build(dataset)
    model = build_model("sparse-lr", dataset, {"init_std": 0.0})
    privacy = Privacy("download", download_keep=0.6, randomness=randomness)  # type: ignore[arg-type]
    schedule = Schedule(
        rounds, CLIENTS, LocalWork(2, 4, ClientStep(0.5)), seed=1,
        execution=Execution(dtype=torch.float64), settings=(privacy,),
    )  # fmt: skip
    built = algorithm_for("fedsubavg", dataset, index, CLIENTS)
    return model, built, dataset, index, schedule


def _requests(args: tuple, control: RunControl | None = None) -> tuple:
    """The final model and the requests of the last round drawn (client -> table -> rows)."""
    kept: list[PrivateRounds] = []
    control = dataclasses.replace(control or RunControl(), watch={"private_rounds": kept.append})
    params = train(*args, control=control)
    return params, {k: {t: r.tolist() for t, r in v.items()} for k, v in kept[0]._requests.items()}


def _tables(params) -> torch.Tensor:
    return next(iter(params.tables.values()))


def test_secret_requests_differ_from_run_to_run_and_from_the_seeded_ones(small_synthetic):
    args = _schedule(small_synthetic, "secret")
    first, second = _requests(args), _requests(args)
    seeded = _requests(_schedule(small_synthetic, "seeded"))
    assert _requests(_schedule(small_synthetic, "seeded"))[1] == seeded[1]  # seeded repeats
    assert first[1] != second[1] and first[1] != seeded[1]
    assert not torch.equal(_tables(first[0]), _tables(second[0]))


def test_a_resumed_secret_run_continues_the_same_requests_bit_for_bit(small_synthetic, tmp_path):
    args = _schedule(small_synthetic, "secret")
    pinned = Secret.fresh()
    with pytest.MonkeyPatch.context() as patch:  # the same secret for both, as one run has
        patch.setattr(secret_streams, "draw_secret", lambda: pinned)
        straight, _ = _requests(args)
        done: list[int] = []
        stop = RunControl(checkpoints=tmp_path, stop_requested=lambda: done[-1] >= 2)
        with pytest.raises(Interrupted) as stopped:
            train(*args, on_round=done.append, control=stop)
    saved = checkpoint_lib.load(stopped.value.checkpoint)
    assert STAGE in saved.stages
    assert bytes(saved.stages[STAGE]["secret"].numpy()) == pinned.to_bytes()
    resumed = train(*args, control=RunControl(resume=saved))  # draws another, reads it back
    assert torch.equal(_tables(resumed), _tables(straight))


def test_a_checkpoint_written_before_the_secret_resumes_seeded_and_says_so(
    small_synthetic, tmp_path, caplog
):
    """A run folder from a fedsub that drew requests from the seed (no ``privacy_secret``
    stage) continues as it started: seeded, which the log and its privacy level say."""
    seeded = _schedule(small_synthetic, "seeded")
    straight, _ = _requests(seeded)
    done: list[int] = []
    stop = RunControl(checkpoints=tmp_path, stop_requested=lambda: done[-1] >= 2)
    with pytest.raises(Interrupted) as stopped:
        train(*seeded, on_round=done.append, control=stop)
    saved = checkpoint_lib.load(stopped.value.checkpoint)
    assert STAGE not in saved.stages
    kept: list[PrivateRounds] = []
    control = RunControl(resume=saved, watch={"private_rounds": kept.append})
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        resumed = train(*_schedule(small_synthetic, "secret"), control=control)
    assert torch.equal(_tables(resumed), _tables(straight))
    assert NOT_PRIVATE in caplog.text
    assert kept[0].drawn_privacy.randomness == "seeded"
    assert levels.describe(kept[0].drawn_privacy)["not_private"] == NOT_PRIVATE
    # stopped again, its checkpoint holds the stage with no secret, and it resumes seeded
    again: list[int] = []
    later = RunControl(
        resume=saved, checkpoints=tmp_path / "again", stop_requested=lambda: again[-1] >= 3
    )
    secret = _schedule(small_synthetic, "secret")
    with pytest.raises(Interrupted) as stopped:
        train(*secret, on_round=again.append, control=later)
    third = checkpoint_lib.load(stopped.value.checkpoint)
    assert STAGE in third.stages and third.stages[STAGE] == {}
    final = train(*secret, control=RunControl(resume=third))
    assert torch.equal(_tables(final), _tables(straight))


@contextlib.contextmanager
def _recording_secrets() -> Iterator[list[Secret]]:
    """Every secret the run draws (``draw_secret``), kept to look for it in what is published."""
    drawn: list[Secret] = []
    fresh = secret_streams.draw_secret

    def recorded() -> Secret:
        drawn.append(fresh())
        return drawn[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(secret_streams, "draw_secret", recorded)
        yield drawn


def test_the_run_folder_publishes_no_secret_and_says_when_the_requests_are_seeded(tmp_path):
    base = (
        "data.num_users=40", "train.clients_per_round=8", "train.rounds=2",
        "train.algorithms=['fedsubavg']", "privacy.level='download'",
        "privacy.secagg_group=8", "train.checkpoint_every=1",
    )  # fmt: skip
    with _recording_secrets() as drawn:
        experiment.compare(config_lib.load(None, base), tmp_path / "secret")
    assert len(drawn) == 1
    secret = drawn[0].to_bytes()
    for path in (tmp_path / "secret").rglob("*"):
        if path.is_file() and "checkpoints" not in path.parts:
            assert secret not in path.read_bytes(), path
            assert secret.hex() not in path.read_bytes().decode("latin-1"), path
    record = json.loads((tmp_path / "secret" / "fedsubavg" / "privacy.json").read_text())
    assert record["randomness"] == "secret" and "not_private" not in record
    seeded = config_lib.load(None, (*base, "privacy.randomness='seeded'"))
    experiment.compare(seeded, tmp_path / "seeded")
    record = json.loads((tmp_path / "seeded" / "fedsubavg" / "privacy.json").read_text())
    assert record["randomness"] == "seeded" and record["not_private"] == NOT_PRIVATE


def test_randomness_without_a_private_download_is_refused():
    with pytest.raises(ConfigError, match=r"privacy\.randomness.*privacy\.level = 'heat'"):
        config_lib.load(None, ("privacy.level='heat'", "privacy.randomness='seeded'"))
    with pytest.raises(ConfigError, match=r"privacy\.randomness"):
        config_lib.load(None, ("privacy.level='download'", "privacy.randomness='public'"))


# -- Flower: each node's own secret, in its run state ------------------------------------------


@pytest.mark.usefixtures("flower_task_identity")
def test_a_flower_node_draws_its_own_secret_and_the_server_never_receives_it():
    from .test_flower_private_download import BASE, RANDOMIZED, _run

    overrides = tuple(o for o in (*BASE, *RANDOMIZED) if "randomness" not in o)
    with _recording_secrets() as drawn:
        strategy, grid = _run(overrides, "submodel", 2)
    assert [r["replies"] for r in strategy.rounds] == [2, 2]  # request and train waves agreed
    assert 1 <= len(drawn) <= 4  # one per node asked (the server draws none)
    secrets = [s.to_bytes() for s in drawn]
    for message in [*grid.sent, *grid.received]:
        assert isinstance(message, Message)
        for record in message.content.config_records.values():
            assert not any(v in secrets for v in record.values())
    assert not any(SECRET in m.content for m in [*grid.sent, *grid.received])
    # the nodes' requests are not the ones the published seed redraws
    seeded, _ = _run((*overrides, "privacy.randomness='seeded'"), "submodel", 2)
    assert any(
        not np.array_equal(strategy.sampled.rows[k]["features"], seeded.sampled.rows[k]["features"])
        for k in strategy.sampled.rows
        if k in seeded.sampled.rows
    )


def test_a_node_keeps_one_secret_for_the_run():
    from flwr.app import Context, RecordDict

    from fedsub.flower.protocols import ContextState
    from fedsub.privacy.download_protocol import NodeRequests

    def node_key(privacy: Privacy, context: Context) -> object:
        requests = NodeRequests(privacy, 5, 0, {}, {})
        return requests.key(ContextState(context))

    context = Context(1, 0, {}, RecordDict(), {})
    first = node_key(Privacy("download"), context)
    assert isinstance(first, Secret)
    assert isinstance(context.state[SECRET], ConfigRecord)
    assert node_key(Privacy("download"), context) == first  # one per run
    other = node_key(Privacy("download"), Context(1, 1, {}, RecordDict(), {}))
    assert other != first  # another node: another secret
    seeded = Privacy("download", randomness="seeded")
    assert node_key(seeded, Context(1, 0, {}, RecordDict(), {})) == 5
