"""Per-stage state as data: every stateful stage of the round (``ServerRound.stages()``) is saved
and restored by engine/checkpoint.py through ``state_tensors`` / ``load_state_tensors`` alone, so
a new stateful piece needs no checkpoint code; old (format 1) checkpoints still load, and state
that does not fit the run is refused with a message naming the stage."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.backends import backend_for
from fedsub.engine.cohort_job import CohortJob
from fedsub.engine.contribution import RoundContribution
from fedsub.engine.execution import Execution
from fedsub.engine.features.assembly import Assembly, build_server_round, combine_of
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.engine.loop import (
    Interrupted,
    Progress,
    RunControl,
    resume,
    save_checkpoint,
)
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.engine.server_round import ServerRound
from fedsub.errors import FedsubError
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.stateful import Stateful
from fedsub.submodel.index import SubmodelIndex

from .conftest import make_dataset
from .equivalence import algorithm_for

SCHEDULE = Schedule(
    3,
    3,
    LocalWork(2, 2, ClientStep(0.5)),
    seed=1,
    execution=Execution(dtype=torch.float64, backend="sequential"),
)
CLIENTS = [[[0, 1], [2]], [[1], [1, 3], [0]], [[3, 4]] * 4, [[2, 4], [0]]]


class RoundLog:
    """A toy stateful stage, as a future server momentum or stateful transform would be:
    its state is whatever tensors it names, unknown to the checkpoint code."""

    def __init__(self) -> None:
        self.rounds = torch.zeros((), dtype=torch.int64)
        self.norms = torch.zeros(0, dtype=torch.float64)

    def record(self, norm: float) -> None:
        self.rounds += 1
        self.norms = torch.cat([self.norms, torch.tensor([norm], dtype=torch.float64)])

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"rounds": self.rounds, "norms": self.norms}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.rounds, self.norms = tensors["rounds"].clone(), tensors["norms"].clone()


def finish(rounds, plan, update) -> bool:
    """The loop's checked server step (engine/loop.py ``run_round``): aggregate, then step."""
    step = rounds.server_step(plan, update)
    return step is not None and step()


def setup(algorithm: str):
    dataset = make_dataset(CLIENTS, table_rows=5)
    index = SubmodelIndex.build(dataset)
    return SparseLogisticRegression(dict(dataset.table_rows)), dataset, index, algorithm


def fresh_round(model, dataset, index, algorithm: str, log: RoundLog):
    built = algorithm_for(algorithm, dataset, index, SCHEDULE.clients_per_round)
    params = initial_params(model, SCHEDULE)
    run_cohort = backend_for(SCHEDULE.execution.backend, model, built.name).run_cohort
    combine = combine_of((), built, SCHEDULE)
    rounds = build_server_round(
        built, dataset, index, SCHEDULE, params, combine, Assembly(), stages={"round-log": log}
    )
    return rounds, run_cohort


def with_stage(rounds: ServerRound, name: str, stage: Stateful) -> ServerRound:
    """``rounds`` with one more contributed stage."""
    more = RoundContribution("test", stages={name: stage})
    features = rounds.features
    features = dataclasses.replace(features, contributions=(*features.contributions, more))
    return dataclasses.replace(rounds, features=features)


def play(rounds, run_cohort, model, dataset, index, log: RoundLog, round_index: int) -> None:
    plan = rounds.begin(round_index)
    job = CohortJob(
        model, rounds.params, dataset, index, plan.cohort, round_index, SCHEDULE, plan.work
    )
    update = run_cohort(job)
    finish(rounds, plan, update)
    log.record(float(sum(p.norm() for p in rounds.params.tensors())))


def test_a_new_stateful_stage_is_saved_and_restored_with_no_checkpoint_code(tmp_path):
    model, dataset, index, algorithm = setup("scaffold")
    log = RoundLog()
    assert isinstance(log, Stateful)
    rounds, run_cohort = fresh_round(model, dataset, index, algorithm, log)
    assert list(rounds.stages()) == ["model", "server", "variates", "round-log"]
    for r in (1, 2):
        play(rounds, run_cohort, model, dataset, index, log, r)
    path = save_checkpoint(tmp_path, rounds, Progress(round=2), {})
    assert (path / "round-log.safetensors").exists()

    restored_log = RoundLog()
    restored, run_cohort = fresh_round(model, dataset, index, algorithm, restored_log)
    progress = resume(restored, checkpoint_lib.load(path))
    assert progress.round == 2 and restored.last_checkpoint == path
    assert int(restored_log.rounds) == 2
    torch.testing.assert_close(restored_log.norms, log.norms, rtol=0, atol=0)
    assert restored_log.norms[1] != restored_log.norms[0]  # the model moved between rounds
    for name, stage in rounds.stages().items():
        expected, got = stage.state_tensors(), restored.stages()[name].state_tensors()
        assert got.keys() == expected.keys(), name
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"{name} {key}")

    play(rounds, run_cohort, model, dataset, index, log, 3)  # both go on alike
    play(restored, run_cohort, model, dataset, index, restored_log, 3)
    for name, value in rounds.params.state_dict().items():
        torch.testing.assert_close(restored.params.state_dict()[name], value, rtol=0, atol=0)


def test_a_stage_may_not_take_a_built_in_stages_name():
    model, dataset, index, algorithm = setup("fedavg")
    rounds, _ = fresh_round(model, dataset, index, algorithm, RoundLog())
    rounds = with_stage(rounds, "server", RoundLog())
    with pytest.raises(ValueError, match="stage name 'server' is taken"):
        rounds.stages()


def stopped_after_round_1(model, dataset, index, algorithm: str, folder):
    built = algorithm_for(algorithm, dataset, index, SCHEDULE.clients_per_round)
    control = RunControl(checkpoints=folder, stop_requested=lambda: True)
    with pytest.raises(Interrupted) as stopped:
        train(model, built, dataset, index, SCHEDULE, control=control)
    return stopped.value.checkpoint


def resumed(model, dataset, index, algorithm: str, saved):
    built = algorithm_for(algorithm, dataset, index, SCHEDULE.clients_per_round)
    return train(model, built, dataset, index, SCHEDULE, control=RunControl(resume=saved))


def as_format_1(path) -> None:
    """Rewrite a checkpoint the way fedsub wrote it before stages were generic."""
    state = json.loads((path / "state.json").read_text())
    del state["stages"]
    state["format"] = 1
    (path / "state.json").write_text(json.dumps(state))
    if not (path / "variates.safetensors").exists():
        save_file({}, str(path / "variates.safetensors"))


@pytest.mark.parametrize("algorithm", ["fedadam", "scaffold"])
def test_a_format_1_checkpoint_still_resumes_to_the_uninterrupted_model(algorithm, tmp_path):
    model, dataset, index, _ = setup(algorithm)
    straight = train(
        model,
        algorithm_for(algorithm, dataset, index, SCHEDULE.clients_per_round),
        dataset,
        index,
        SCHEDULE,
    )
    path = stopped_after_round_1(model, dataset, index, algorithm, tmp_path)
    as_format_1(path)
    saved = checkpoint_lib.load(path)
    expected = {"model", "server", "variates"} if algorithm == "scaffold" else {"model", "server"}
    assert set(saved.stages) == expected
    got = resumed(model, dataset, index, algorithm, saved)
    for name, value in straight.state_dict().items():
        torch.testing.assert_close(got.state_dict()[name], value, rtol=0, atol=1e-12)


def test_a_checkpoint_of_an_unknown_format_is_refused(tmp_path):
    model, dataset, index, algorithm = setup("fedavg")
    path = stopped_after_round_1(model, dataset, index, algorithm, tmp_path)
    state = json.loads((path / "state.json").read_text())
    (path / "state.json").write_text(json.dumps({**state, "format": 99}))
    with pytest.raises(FedsubError, match=r"checkpoint format 99, expected 2 \(or 1\)"):
        checkpoint_lib.load(path)


@pytest.mark.parametrize(
    "saved_by,resumed_by,message",
    [
        ("scaffold", "fedavg", "this run has no variates"),
        ("fedavg", "scaffold", "it lacks variates"),
        (
            "fedadam",
            "fedyogi",
            r"stage 'server' does not fit this run: adaptive server state: expected tensors "
            r"\['yogi\.full\.m\.",
        ),
    ],
)
def test_stages_that_do_not_fit_the_run_are_refused(saved_by, resumed_by, message, tmp_path):
    model, dataset, index, _ = setup(saved_by)
    saved = checkpoint_lib.load(stopped_after_round_1(model, dataset, index, saved_by, tmp_path))
    with pytest.raises(FedsubError, match=message) as error:
        resumed(model, dataset, index, resumed_by, saved)
    assert str(error.value).startswith(str(saved.path))


def test_saved_parameters_of_another_shape_are_refused(tmp_path):
    model, dataset, index, algorithm = setup("fedavg")
    saved = checkpoint_lib.load(stopped_after_round_1(model, dataset, index, algorithm, tmp_path))
    wider = SparseLogisticRegression({"t": 7})
    with pytest.raises(FedsubError, match=r"stage 'model' .* has shape \(5, 1\), this model's"):
        resumed(wider, dataset, index, algorithm, saved)


def test_stage_names_must_be_file_names(tmp_path):
    model, dataset, index, algorithm = setup("fedavg")
    rounds, _ = fresh_round(model, dataset, index, algorithm, RoundLog())
    rounds = with_stage(rounds, "../log", RoundLog())
    with pytest.raises(ValueError, match=r"stage name '\.\./log' is not"):
        save_checkpoint(tmp_path, rounds, Progress(round=1), {})
    assert list(tmp_path.iterdir()) == []  # nothing half-written

    path = stopped_after_round_1(model, dataset, index, algorithm, tmp_path / "run")
    state = json.loads((path / "state.json").read_text())
    (path / "state.json").write_text(json.dumps({**state, "stages": ["model", "../server"]}))
    with pytest.raises(FedsubError, match=r"state\.json's stages must be a list of stage names"):
        checkpoint_lib.load(path)
