"""runs/run_session.py: the run folder's session every runtime shares (``fedsub compare``,
the Flower ServerApp's out-dir, and a third runtime written here, ``HalfOffline``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedsub.algorithms.registry import build_algorithm
from fedsub.config import Config
from fedsub.engine.features.assembly import Assembly, assemble
from fedsub.engine.in_process import InProcess
from fedsub.engine.loop import Interrupted, RunControl
from fedsub.files.run_folder import RUN_FILE, RunIdentity, checkpoint_outputs, claim_new
from fedsub.runs.run_identity import IN_CONFIG_FILE
from fedsub.runs.run_session import (
    RunSession,
    Tracked,
    checkpointed,
    holding,
    start_fresh,
    write_model,
)
from fedsub.runs.run_setup import prepare
from fedsub.runs.tracking import RunCallback, TrackedRun
from fedsub.submodel.params import Params


def _new_run(folder):
    """A claimed folder with a new run's run.json, as a run writes it before round 1."""
    claim = claim_new(folder)
    claim.write_run_file({"run_id": "r", "config_hash": "h", "outputs": [RUN_FILE]})
    return claim


def test_a_new_run_that_fails_before_training_leaves_no_folder(tmp_path):
    folder = tmp_path / "run"
    with pytest.raises(RuntimeError, match="boom"), holding(_new_run(folder)):
        raise RuntimeError("boom")
    assert not folder.exists()


def test_a_run_stopped_after_a_checkpoint_keeps_its_folder_and_lets_it_go(tmp_path):
    """A stop (Interrupted) is a run to resume, not a failure: nothing is undone."""
    folder = tmp_path / "run"
    with pytest.raises(Interrupted), holding(_new_run(folder)):
        raise Interrupted(2, folder / "checkpoints" / "round-000002")
    assert (folder / RUN_FILE).exists()
    claim_new(folder, overwrite=True).end(failed=False)  # the lock was released


def test_a_run_that_ends_keeps_its_folder(tmp_path):
    folder = tmp_path / "run"
    with holding(_new_run(folder)):
        pass
    assert (folder / RUN_FILE).exists()


def test_checkpointed_adds_the_folders_checkpoints_to_the_runtimes_guards(tmp_path):
    identity = RunIdentity("abc", "0123")
    guards = RunControl(max_update_norm=2.5, divergence_factor=3.0)
    control = checkpointed(guards, tmp_path, 4, identity)
    assert control.checkpoints == tmp_path / "checkpoints"
    assert control.checkpoint_every == 4
    assert control.run == {"run_id": "abc", "config_hash": "0123"}
    assert control.resume is None
    assert (control.max_update_norm, control.divergence_factor) == (2.5, 3.0)
    assert guards.checkpoints is None and guards.run == {}  # the guards given are kept as they are
    assert checkpointed(guards, None, 4, identity).checkpoints is None  # writes nothing


def test_a_fresh_start_forgets_the_earlier_attempts_checkpoints_and_named_files(tmp_path):
    (tmp_path / "checkpoints" / "round-000003").mkdir(parents=True)
    for name in ("done", "rejections.jsonl", "metrics.jsonl"):
        (tmp_path / name).write_text("earlier\n")
    start_fresh(tmp_path, "done", "rejections.jsonl", "absent.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_fresh_start_may_keep_the_checkpoints_folder(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "progress.jsonl").write_text("{}\n")
    start_fresh(tmp_path, "progress.jsonl", checkpoints=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_the_model_is_written_as_model_safetensors_with_its_flat_names(tmp_path):
    params = Params({"user": torch.arange(6.0).reshape(3, 2)}, {"bias": torch.tensor([0.5])})
    write_model(tmp_path, params)
    written = load_file(tmp_path / "model.safetensors")
    assert sorted(written) == ["dense.bias", "table.user"]
    assert torch.equal(written["table.user"], torch.arange(6.0).reshape(3, 2))
    assert torch.equal(written["dense.bias"], torch.tensor([0.5]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


# --- a third runtime on the session ----------------------------------------------------------


@dataclass
class HalfOffline:
    """A runtime written for this test: the in-process engine, but on odd rounds only the
    even-numbered clients are reachable. It writes nothing of its own: folder, identity,
    checkpoints, resume, metrics, trackers and model are the session's."""

    engines: dict[str, InProcess]  # the run's engine, once its rounds are assembled

    @property
    def engine(self) -> InProcess:
        return self.engines["in-process"]

    def available(self, round_index, rounds):
        n = self.engine.dataset.num_clients
        return np.arange(0, n, 2) if round_index % 2 else None

    def run_cohort(self, plan, params):
        return self.engine.run_cohort(plan, params)

    def close_round(self, round_index, updated, diverged):
        return None

    def evaluate(self, round_index, params):
        return self.engine.evaluate(round_index, params)

    def history(self):
        return []

    def restore_history(self, history):
        return None


TOY_CONFIG = {
    "train": {"rounds": 4, "clients_per_round": 5, "checkpoint_every": 1,
              "algorithms": ["fedavg"]},
    "eval": {"every": 1},
}  # fmt: skip
TOY_OUTPUTS = [RUN_FILE, "config.toml", "metrics.jsonl", "model.safetensors", "done",
               *checkpoint_outputs("checkpoints")]  # fmt: skip


def run_half_offline(folder, resume=False, stop_after=0, callbacks=()):
    """The toy runtime's run in ``folder``, as a runtime's author writes it: its setup and its
    ``RoundRuntime``; everything about the folder from ``RunSession``."""
    config = Config.from_dict(TOY_CONFIG)
    setup = prepare(config)
    algorithm = build_algorithm("fedavg", setup.context, config.algorithm_options("fedavg"))
    done: list[int] = []
    with RunSession.opened(folder, resume) as session:
        session.begin(config.to_toml(), IN_CONFIG_FILE, {"kind": "toy", "outputs": TOY_OUTPUTS})
        saved = session.newest() if resume else None
        run = TrackedRun("fedavg", "toy-fedavg", runtime="half-offline")
        attempt = session.attempt("", saved, 1, tracked=Tracked(tuple(callbacks), run))
        engines: dict[str, InProcess] = {}

        def open_rounds(control):
            assembly = Assembly(control.max_update_norm, control.on_reject)
            run = assemble(
                setup.model, algorithm, setup.dataset, setup.index, setup.schedule, assembly
            )
            evaluate = run.rounds.features.evaluate(setup.evaluator)
            engines["in-process"] = InProcess(
                setup.model, setup.dataset, setup.index, setup.schedule, run.run_cohort, evaluate
            )
            return run.rounds

        def stop() -> bool:  # asked after every round
            done.append(1)
            return len(done) == stop_after

        guards = RunControl(stop_requested=stop)
        ended = None
        try:
            attempt.drive(open_rounds, HalfOffline(engines), setup.schedule, guards)
        except BaseException as error:
            ended = error
            raise
        finally:
            attempt.end(ended)
        attempt.write_model(attempt.rounds.params)
        attempt.mark_done()
    return attempt


def test_a_third_runtime_gets_its_folder_and_resume_from_the_session(tmp_path):
    """The toy runtime, stopped after round 2 and resumed, ends with the uninterrupted run's
    model (bytes) and metrics.jsonl (elapsed aside), its run.json, checkpoints and completion
    marker written by the session, and the trackers told of every round."""
    whole = tmp_path / "whole"
    run_half_offline(whole)
    split = tmp_path / "split"
    with pytest.raises(Interrupted):
        run_half_offline(split, stop_after=2)
    assert not (split / "done").exists() and (split / "checkpoints" / "round-000002").exists()

    seen: list[tuple[int, int]] = []

    class Rounds(RunCallback):
        def after_round(self, run, round_index, metrics):
            seen.append((run.resumed_after, round_index))

    run_half_offline(split, resume=True, callbacks=[Rounds()])
    assert seen == [(2, 0), (2, 1), (2, 2), (2, 3), (2, 4)]
    assert (whole / "model.safetensors").read_bytes() == (split / "model.safetensors").read_bytes()

    def metrics(folder):
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return [{**json.loads(x), "elapsed": 0} for x in lines]

    assert metrics(whole) == metrics(split) and len(metrics(whole)) == 5
    record = json.loads((split / RUN_FILE).read_text())
    assert record["kind"] == "toy" and (split / "config.toml").exists()
    assert json.loads((split / "done").read_text())["run_id"] == record["run_id"]
