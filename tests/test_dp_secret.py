"""[dp]'s secret randomness (fedsub/dp/randomness.py), tested as a privacy reviewer would: round
r's noise differs from round r + 1's and run A's from run B's; the attack (redraw the noise
from everything a run folder publishes and subtract it from the released model) leaves noise
of the full std; the secret appears in no published file, only in the checkpoints; a resumed
run continues its streams bit for bit; torchrun's processes use one secret. Seeded mode
(dp.randomness = "seeded") repeats bit for bit and says its epsilon is no guarantee."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedsub.algorithms.registry import build_algorithm
from fedsub.config import Config
from fedsub.dp.mechanism import DpMechanism, gaussian, round_generator
from fedsub.dp.randomness import NOT_A_GUARANTEE, DpStreams, streams_of
from fedsub.dp.settings import DpSettings
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine import loop
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.engine.loop import Interrupted, RunControl
from fedsub.engine.server_round import ServerRound
from fedsub.numerics import secret_streams
from fedsub.numerics.seeding import Secret
from fedsub.runs import experiment
from fedsub.runs.run_setup import prepare

from .test_dp import SMALL
from .test_dp_audit import canary_update, settings_of

SECRET_DP = ["dp.mechanism='gaussian'", "dp.noise_multiplier=0.8", "dp.clip=0.5"]


def config(*overrides: str) -> Config:
    return Config.from_toml(None, [*SMALL, *SECRET_DP, *overrides])


def round_noise(mechanism: DpMechanism, round_index: int) -> torch.Tensor:
    """What round ``round_index`` adds to a table of untouched rows: its noise / D."""
    update = canary_update(np.zeros(0, dtype=np.int64), 0)
    return mechanism.combine(update, round_index).tables["t"].values[:, 0]


def mechanism_of(randomness_: str) -> DpMechanism:
    settings = settings_of(2.0, 4000, 40, randomness_)
    return DpMechanism(settings, {"t": 4000}, np.ones(4000))


def test_the_noise_differs_between_rounds_and_runs_and_repeats_only_when_seeded():
    a, b = mechanism_of("secret"), mechanism_of("secret")  # two runs of one config
    std = 2.0 / 40  # z C / D
    first, second, other = round_noise(a, 1), round_noise(a, 2), round_noise(b, 1)
    for x in (first, second, other):
        assert float(x.std()) == pytest.approx(std, rel=0.05)
    for x, y in [(first, second), (first, other)]:  # independent: differencing cancels nothing
        assert float((x - y).std()) == pytest.approx(std * 2**0.5, rel=0.05)
        assert abs(float(np.corrcoef(x.numpy(), y.numpy())[0, 1])) < 0.1
    assert torch.equal(round_noise(a, 1), first)  # a round's noise is a function of its key
    seeded, again = mechanism_of("seeded"), mechanism_of("seeded")
    assert torch.equal(round_noise(seeded, 3), round_noise(again, 3))
    redrawn = gaussian((4000, 1), 2.0, round_generator(0, 3))[:, 0] / 40
    assert torch.equal(round_noise(seeded, 3), redrawn)  # seeded: anyone redraws it
    assert not torch.equal(round_noise(seeded, 3), round_noise(seeded, 4))


def cohorts(c: Config) -> list[list[int]]:
    """The cohorts a run of ``c`` (fedavg) drew, round by round."""
    drawn: list[list[int]] = []
    begin = ServerRound.begin

    def recording(self, round_index, among=None):
        plan = begin(self, round_index, among)
        drawn.append(plan.cohort.clients.tolist())
        return plan

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ServerRound, "begin", recording)
        experiment.compare(c, None)
    return drawn


def test_the_cohorts_are_secret_under_dp_and_the_seeds_otherwise():
    overrides = ("train.algorithms=['fedavg']", "train.sampling='poisson'")
    a, b = cohorts(config(*overrides)), cohorts(config(*overrides))
    seeded = cohorts(config(*overrides, "dp.randomness='seeded'"))
    plain = cohorts(Config.from_toml(None, [*SMALL, *overrides]))
    assert seeded == plain  # seeded: the cohorts of the run without [dp]
    assert a != b and a != plain and b != plain
    assert len(a) == 4 and all(len(c) > 0 for c in a)


# -- the attack: everything a run folder publishes ---------------------------------------------


def residual_std(folder: Path) -> float:
    """The attack: read the seed in config.toml, redraw every round's noise with fedsub's own
    generator and the initial model, subtract them from the released model (fedavg: the sum
    of the rounds' (clipped sum + noise) / D, D = K); the robust std (median absolute value /
    0.6745) of what is left on the tables, in units of one round's noise std."""
    published = Config.from_toml(folder / "config.toml")
    setup = prepare(published)
    start = initial_params(setup.model, setup.schedule).tables
    released = load_file(folder / "fedavg" / "model.safetensors")
    settings = setup.schedule.setting(DpSettings)
    assert settings is not None
    std = settings.update_multiplier * settings.clip
    residuals = []
    for table in sorted(start):
        residuals.append(
            (released[f"table.{table}"] - start[table]) * published.train.clients_per_round
        )
    for r in range(1, published.train.rounds + 1):
        generator = round_generator(published.train.seed, r)
        for j, table in enumerate(sorted(start)):  # the mechanism's order: tables by name
            residuals[j] = residuals[j] - gaussian(tuple(start[table].shape), std, generator)
    residual = torch.cat([r.flatten() for r in residuals])
    return float(residual.abs().median()) / 0.6745 / std


def test_the_attack_redrawing_the_noise_from_the_published_seed_fails(published):
    # secret: two rounds' noise, minus two independent redraws: std sqrt(4) of one round's
    assert residual_std(published["secret"]) == pytest.approx(2.0, rel=0.1)
    # seeded (the planted design): the noise cancels, the exact clipped sums are left
    assert residual_std(published["seeded"]) < 1e-6


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> dict[str, Path]:
    """Two-round fedavg runs with noise on every row, secret and seeded, in run folders with
    a checkpoint (after round 1), the secret the secret run drew and the runs' log."""
    folders, drawn = {}, []
    fresh = secret_streams.draw_secret

    def recorded() -> Secret:
        drawn.append(fresh())
        return drawn[-1]

    logged = io.StringIO()  # every log line of the runs, at every level
    handler = logging.StreamHandler(logged)
    logger = logging.getLogger("fedsub")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(secret_streams, "draw_secret", recorded)
        for mode in ("secret", "seeded"):
            folder = tmp_path_factory.mktemp(mode)
            c = config(
                "dp.rows='all'",
                "train.algorithms=['fedavg']",
                "train.rounds=2",
                "train.checkpoint_every=1",
                f"dp.randomness='{mode}'",
            )
            experiment.compare(c, folder)
            folders[mode] = folder
    logger.removeHandler(handler)
    logger.setLevel(level)
    (folders["secret"].parent / "log.txt").write_text(logged.getvalue())
    folders["log"] = folders["secret"].parent / "log.txt"
    assert len(drawn) == 1  # one run drew a secret: the secret one
    folders["secret-bytes"] = drawn[0].to_bytes()  # type: ignore[assignment]
    return folders


def published_files(folder: Path) -> list[Path]:
    """Every file of a run folder an operator may publish: all but the checkpoints."""
    return [p for p in folder.rglob("*") if p.is_file() and "checkpoints" not in p.parts]


def test_the_secret_is_in_no_published_file_only_in_the_checkpoints(published):
    secret = published["secret-bytes"]
    value = int.from_bytes(secret, "little")
    forms = [
        secret,
        secret[::-1],
        secret.hex().encode(),
        str(value).encode(),
        f"{value:x}".encode(),
    ]
    files = published_files(published["secret"])
    assert {"config.toml", "run.json", "summary.json", "summary.md"} <= {p.name for p in files}
    for path in files:
        data = path.read_bytes()
        assert not any(form in data for form in forms), path
    kept = list((published["secret"] / "fedavg" / "checkpoints").rglob("dp_secret.safetensors"))
    assert kept and all(secret in p.read_bytes() for p in kept)  # where it lives
    log = published["log"].read_text()
    assert NOT_A_GUARANTEE in log  # the seeded run's warning: the log was captured
    assert not any(form.decode() in log for form in forms[2:])
    # seeded: no secret to keep, and no checkpoint stage for one
    assert not list(published["seeded"].rglob("dp_secret.safetensors"))


def test_a_seeded_run_says_its_epsilon_is_no_guarantee_and_a_secret_run_does_not(published):
    for mode, says in [("seeded", True), ("secret", False)]:
        folder = published[mode]
        record = json.loads((folder / "summary.json").read_text())["algorithms"]["fedavg"]["dp"]
        assert record["randomness"] == mode
        assert ("not_a_guarantee" in record) is says
        markdown = (folder / "summary.md").read_text()
        assert ("The epsilon above is not a guarantee" in markdown) is says
        assert (NOT_A_GUARANTEE in markdown) is says


def test_a_seeded_run_warns_at_the_start(caplog):
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        DpStreams("seeded", 0)  # the object alone says nothing: the run's start does
        assert NOT_A_GUARANTEE not in caplog.text
        streams_of("seeded", 0)
    assert NOT_A_GUARANTEE in caplog.text


# -- resume -------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["dp.adaptive_clip=true", "train.sampling='poisson'"]])
def test_a_resumed_secret_run_continues_the_same_streams_bit_for_bit(tmp_path, extra):
    c = config("train.algorithms=['fedsubavg']", "eval.every=1", *extra)
    setup = prepare(c)
    algorithm = build_algorithm("fedsubavg", setup.context)
    args = (setup.model, algorithm, setup.dataset, setup.index, setup.schedule, setup.evaluator)
    pinned = Secret.fresh()
    with pytest.MonkeyPatch.context() as patch:  # the same secret for both, as one run has
        patch.setattr(secret_streams, "draw_secret", lambda: pinned)
        straight: list = []
        final = train(*args, on_evaluation=straight.append)
        done: list[int] = []
        stop = RunControl(checkpoints=tmp_path, stop_requested=lambda: done[-1] >= 2)
        with pytest.raises(Interrupted) as stopped:
            train(*args, on_round=done.append, control=stop)
    saved = checkpoint_lib.load(stopped.value.checkpoint)
    assert "dp_secret" in saved.stages
    resumed: list = []  # draws a fresh secret, then reads the checkpoint's back
    again = train(*args, on_evaluation=resumed.append, control=RunControl(resume=saved))
    assert [e.metrics for e in resumed] == [e.metrics for e in straight[3:]]
    for key, value in final.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    other = train(*args)  # another secret: another model
    assert not all(torch.equal(other.state_dict()[k], v) for k, v in final.state_dict().items())


def test_a_checkpoint_without_the_secret_is_refused_by_a_secret_run(tmp_path):
    c = config("train.algorithms=['fedavg']", "dp.randomness='seeded'")
    setup = prepare(c)
    algorithm = build_algorithm("fedavg", setup.context)
    args = (setup.model, algorithm, setup.dataset, setup.index, setup.schedule, setup.evaluator)
    done: list[int] = []
    stop = RunControl(checkpoints=tmp_path, stop_requested=lambda: done[-1] >= 1)
    with pytest.raises(Interrupted) as stopped:
        train(*args, on_round=done.append, control=stop)
    saved = checkpoint_lib.load(stopped.value.checkpoint)
    secret = prepare(config("train.algorithms=['fedavg']")).schedule
    with pytest.raises(Exception, match="lacks dp_secret"):
        train(*args[:4], secret, setup.evaluator, control=RunControl(resume=saved))


def test_the_secret_stage_round_trips_and_refuses_other_tensors():
    streams = DpStreams("secret", 0)
    state = streams.state_tensors()
    other = DpStreams("secret", 0)
    assert other.key != streams.key
    other.load_state_tensors(state)
    assert other.key == streams.key and "hidden" in repr(other.key)
    with pytest.raises(ValueError, match="one uint8 'secret'"):
        other.load_state_tensors({"clip": torch.zeros(1)})
    with pytest.raises(ValueError, match="32 bytes"):
        other.load_state_tensors({"secret": torch.zeros(3, dtype=torch.uint8)})


# -- torchrun: one secret for every process ----------------------------------------------------

PROCESSES_SCRIPT = """
import hashlib, json, sys
import torch
from fedsub import distributed
from fedsub.algorithms.registry import build_algorithm
from fedsub.config import Config
from fedsub.engine import in_process
from fedsub.engine.features import dp as dp_feature
from fedsub.runs.run_setup import prepare

processes = distributed.join(torch.device("cpu"))
setup = prepare(Config.from_toml(None, json.loads(sys.argv[2])))
algorithm = build_algorithm("fedavg", setup.context)
secrets, original = [], dp_feature.streams_of

def recording(mode, seed):
    streams = original(mode, seed)
    secrets.append(streams.secret.to_bytes().hex())
    return streams

def digest():
    params = in_process.train(setup.model, algorithm, setup.dataset, setup.index, setup.schedule)
    state = sorted(params.state_dict().items())
    return hashlib.sha256(b"".join(v.numpy().tobytes() for _, v in state)).hexdigest()

dp_feature.streams_of = recording
shared = digest()
distributed.from_first = lambda value, what: value  # planted: each process its own secret
own = digest()
gathered = distributed.all_gather((secrets, shared, own), "the test's result")
if processes.rank == 0:
    Path = __import__("pathlib").Path
    Path(sys.argv[1]).write_text(json.dumps(gathered))
distributed.leave()
"""


def test_torchrun_processes_share_process_0s_secret_and_agree_bit_for_bit(tmp_path):
    script, out = tmp_path / "processes.py", tmp_path / "out.json"
    script.write_text(PROCESSES_SCRIPT)
    overrides = [*SMALL, *SECRET_DP, "train.algorithms=['fedavg']", "train.rounds=2"]
    done = torchrun_script(tmp_path, script, str(out), json.dumps(overrides))
    assert done.returncode == 0, done.stderr[-3000:]
    (secrets_0, shared_0, own_0), (secrets_1, shared_1, own_1) = json.loads(out.read_text())
    assert secrets_0[0] == secrets_1[0]  # process 0's secret, in both
    assert shared_0 == shared_1  # the same noise and cohorts: the same model
    assert secrets_0[1] != secrets_1[1] and own_0 != own_1  # planted: they would not agree


def torchrun_script(folder: Path, script: Path, *args: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 SCRIPT ARGS`` (gloo on the CPU), with this
    checkout's fedsub (tests/test_distributed.py's ``torchrun`` for a script)."""
    import os

    import fedsub

    env = {
        **os.environ,
        "PYTHONPATH": str(Path(fedsub.__file__).parents[1]),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return subprocess.run(
        [*command, "--nproc-per-node", "2", str(script), *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def straight_and_stopped(c: Config, tmp_path: Path, stop_after: int) -> None:
    """Under one pinned secret: ``c`` run uninterrupted into ``tmp_path / "straight"``, and
    stopped after round ``stop_after`` (as Ctrl-C stops it: a checkpoint, then Interrupted)
    into ``tmp_path / "stopped"``, left there to be resumed."""
    pinned = Secret.fresh()
    stop = {"after": False}

    def stopped(algorithm: str, round_index: int) -> None:
        stop["after"] = round_index == stop_after

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(secret_streams, "draw_secret", lambda: pinned)
        experiment.compare(c, tmp_path / "straight")
        with pytest.raises(Interrupted):
            experiment.compare(
                c, tmp_path / "stopped", stopped, stop_requested=lambda: stop["after"]
            )


def test_a_stopped_secret_run_folder_resumes_to_the_uninterrupted_files_byte_for_byte(tmp_path):
    """A [dp] run stopped after round 2 (as Ctrl-C stops it: a checkpoint, then Interrupted) and
    resumed in its folder writes the model file and the epsilon lines of the same run (the same
    secret) uninterrupted, byte for byte: the resume drew a fresh secret and read the
    checkpoint's back."""
    c = config("train.algorithms=['fedsubavg']", "eval.every=1", "train.checkpoint_every=0")
    straight_and_stopped(c, tmp_path, 2)
    experiment.compare(c, tmp_path / "stopped", resume=True)
    a, b = (tmp_path / run / "fedsubavg" for run in ("straight", "stopped"))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()

    def lines(folder: Path) -> list[str]:  # metrics.jsonl without the wall-clock seconds
        records = [json.loads(line) for line in (folder / "metrics.jsonl").open()]
        return [json.dumps({k: v for k, v in r.items() if k != "elapsed"}) for r in records]

    assert lines(a) == lines(b) and len(lines(b)) == 5  # rounds 0 to 4, epsilon on each


def dying_in_round(killed: int) -> Callable:
    """``loop.run_round`` that raises (a killed process, no checkpoint written) in round
    ``killed``."""
    run_round = loop.run_round

    def dying(rounds: ServerRound, runtime: object, round_index: int) -> None:
        if round_index == killed:
            raise RuntimeError("killed")
        run_round(rounds, runtime, round_index)  # type: ignore[arg-type]

    return dying


def test_a_run_that_dies_before_its_first_checkpoint_resumes_on_the_same_secret(tmp_path):
    """A [dp] run killed in round 3 with no checkpoint due yet (every 10) has published rounds 0
    to 2's epsilon and metrics; its secret was checkpointed before round 1, so the resume reads it
    back and releases rounds 1 and 2 again identical (the same noise), not a second time under
    fresh noise (a release the accounting would not count)."""
    c = config("train.algorithms=['fedsubavg']", "eval.every=1", "train.checkpoint_every=10")
    folder = tmp_path / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "run_round", dying_in_round(3))
        with pytest.raises(RuntimeError, match="killed"):
            experiment.compare(c, folder)
    saved = sorted((folder / "fedsubavg/checkpoints").iterdir())
    assert [checkpoint_lib.load(p).round for p in saved] == [0]
    assert "dp_secret" in checkpoint_lib.load(saved[0]).stages
    published = (folder / "fedsubavg/metrics.jsonl").read_text().splitlines()
    experiment.compare(c, folder, resume=True)  # draws a fresh secret, reads the saved one

    def without_elapsed(lines: list[str]) -> list[dict]:
        return [{k: v for k, v in json.loads(x).items() if k != "elapsed"} for x in lines]

    again = (folder / "fedsubavg/metrics.jsonl").read_text().splitlines()
    assert len(published) == 3 and len(again) == 5  # rounds 0-2, then 0-4
    assert without_elapsed(again[:3]) == without_elapsed(published)


@pytest.mark.parametrize(
    ("extra", "name", "central", "heat", "keep"),
    [
        ([], "fedavg", True, False, 1.0),
        ([], "fedsubavg", True, True, 1.0),
        (["privacy.level='download'", "privacy.download_keep=0.8"], "fedavg", True, False, 0.8),
        (["dp.rows='all'", "privacy.level='full'"], "fedavg", False, None, None),
    ],
)
def test_the_server_round_shares_one_secret_with_the_mechanism_it_builds(
    extra, name, central, heat, keep
):
    """build_server_round: the cohort's key is the mechanism's (one secret, checkpointed once);
    the central mechanism reads the rule's heat and the download's p, and at "full" there is
    none (the clients add the noise)."""
    from fedsub.engine.features.assembly import Assembly, build_server_round
    from fedsub.engine.features.dp import dp_round_of

    setup = prepare(config(f"train.algorithms=['{name}']", *extra))
    algorithm = build_algorithm(name, setup.context)
    params = initial_params(setup.model, setup.schedule)
    rounds = build_server_round(
        algorithm, setup.dataset, setup.index, setup.schedule, params, lambda u: u, Assembly()
    )
    dp = dp_round_of(rounds.features)
    assert dp is not None and dp.streams.guaranteed
    assert rounds.features.sampling_key(setup.schedule.seed) is dp.streams.key
    assert rounds.stages()["dp_secret"] is dp.streams
    if central:
        assert dp.mechanism is not None and dp.mechanism.streams is dp.streams
        assert dp.mechanism.heat is heat and dp.mechanism.keep == keep
    else:
        assert dp.mechanism is None
