"""A Flower run started from a model file fedsub wrote (run config ``initial-model``): it
continues that model as the in-process engine would, a file that is not the run's model is
refused before round 1, and the file is part of the run's identity (a resume refuses another)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedsub.engine import initial as initial_lib
from fedsub.engine.features import assembly
from fedsub.errors import FedsubError
from fedsub.flower.settings import INITIAL_MODEL, Deployment, FlowerSettings, Output, Replies
from fedsub.submodel.params import Params

from .test_flower import OVERRIDES, in_process_model
from .test_flower_resume_old import serve
from .test_initial_model import bad_model_files

pytestmark = pytest.mark.usefixtures("flower_task_identity")
REPLIES = Replies(round_timeout=30.0)


def settings(initial: str = "", **output) -> FlowerSettings:
    return FlowerSettings(
        overrides=OVERRIDES,
        replies=REPLIES,
        deployment=Deployment(initial_model=initial),
        output=Output(**output),
    )


def drawn_tensors() -> dict[str, torch.Tensor]:
    """The run's model as drawn (the tensors a file must match), from the run's own setup."""
    from fedsub.flower.run_model import federation

    fed = federation(settings())
    return initial_lib.initial_params(fed.model, fed.schedule).state_dict()


def test_a_run_from_a_model_file_continues_it_as_the_in_process_engine_would(tmp_path, monkeypatch):
    """Run 1 writes model.safetensors; run 2 starts from it. Its model is the in-process
    engine's run whose round-0 model is that file's (not the seeded draw)."""
    first, second = tmp_path / "first", tmp_path / "second"
    serve(settings(out_dir=str(first)))
    start = load_file(first / "model.safetensors")
    assert float(start["table.features"].abs().sum()) > 0  # not the draw (zeros): trained
    serve(settings(str(first / "model.safetensors"), out_dir=str(second)))
    flower = load_file(second / "model.safetensors")

    def from_the_file(model, schedule) -> Params:
        return Params.from_state_dict({n: v.clone() for n, v in start.items()})

    monkeypatch.setattr(assembly, "initial_params", from_the_file)
    expected = in_process_model(OVERRIDES)
    monkeypatch.undo()
    assert set(flower) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(flower[name], value, rtol=0, atol=1e-5)
    # the same rounds from the draw end elsewhere: the file's model was the start
    assert any(not torch.allclose(flower[n], v, atol=1e-3) for n, v in start.items())
    result = json.loads((second / "flower-result.json").read_text())
    assert [r["replies"] for r in result["rounds"]] == [3, 3, 3]


def test_a_file_that_is_not_the_runs_model_is_refused_before_round_1(tmp_path):
    """Each error names the key, the file and the tensor; the out-dir is left as it was."""
    for index, (path, expected) in enumerate(bad_model_files(tmp_path, drawn_tensors())):
        out = tmp_path / f"out{index}"
        with pytest.raises(FedsubError, match=rf"initial-model = '{path}'.*{expected}"):
            serve(settings(path, out_dir=str(out)))
        assert not out.exists()  # nothing written


def test_the_file_is_part_of_the_runs_identity(tmp_path):
    """The description (the checkpoints' config hash) holds the digest of the file's bytes
    only when the key is set: a run from the draw keeps the description it always had."""
    model = tmp_path / "model.safetensors"
    save_file(drawn_tensors(), str(model))
    plain = settings().description("[train]\n", "fedsubavg")
    assert plain == (
        "[train]\n\n# flower\nalgorithm = 'fedsubavg'\npayload = 'submodel'\n"
        "heat-refresh-every = 1\n"
    )
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    given = settings(str(model)).description("[train]\n", "fedsubavg")
    assert given == f"{plain}initial-model = 'sha256:{digest}'\n"


def test_a_resumed_run_refuses_another_model_file(tmp_path):
    """Resuming with another file (or none) is refused; with the same bytes it resumes."""
    tensors = drawn_tensors()
    one, other = tmp_path / "one.safetensors", tmp_path / "other.safetensors"
    save_file({n: v + 0.5 for n, v in tensors.items()}, str(one))
    save_file({n: v - 0.5 for n, v in tensors.items()}, str(other))
    out = tmp_path / "out"
    serve(settings(str(one), out_dir=str(out), checkpoint_every=1))
    whole = load_file(out / "model.safetensors")
    for initial in (str(other), ""):
        with pytest.raises(
            FedsubError, match=r"initial-model \(the file's bytes\) \(hash \w+\) is not"
        ):
            serve(settings(initial, out_dir=str(out), resume=True))
    moved = tmp_path / "moved.safetensors"
    moved.write_bytes(one.read_bytes())  # its bytes, not its path, are the run's
    assert serve(settings(str(moved), out_dir=str(out), resume=True)) == [3, 3, 3]
    for name, value in load_file(out / "model.safetensors").items():  # as uninterrupted
        torch.testing.assert_close(value, whole[name], rtol=0, atol=0)


def test_the_run_config_key_expands_home():
    from pathlib import Path

    parsed = FlowerSettings.from_run_config({"initial-model": "~/runs/a/model.safetensors"})
    assert parsed.deployment.initial_model == str(Path.home() / "runs/a/model.safetensors")
    assert FlowerSettings.from_run_config({}).deployment.initial_model == ""


def test_the_file_a_row_sharded_run_writes_is_the_start(tmp_path):
    """The sharded writer's file (its own header layout, sharding/model_file.py) passes the
    check and is the run's round-0 model exactly, in the model's order of tensors."""
    from fedsub.distributed import Processes
    from fedsub.flower.run_model import federation
    from fedsub.runs.initial_model import starting_params
    from fedsub.sharding.model_file import write_model
    from fedsub.sharding.rounds import shard

    fed = federation(settings())
    drawn = initial_lib.initial_params(fed.model, fed.schedule)
    trained = Params.from_state_dict({n: v + 0.25 for n, v in drawn.state_dict().items()})
    path = tmp_path / "model.safetensors"
    write_model(path, shard(trained, Processes(0, 1)))
    start = starting_params(fed.model, fed.schedule, str(path), INITIAL_MODEL)
    assert list(start.state_dict()) == list(drawn.state_dict())
    for name, value in trained.state_dict().items():
        assert torch.equal(start.state_dict()[name], value), name
    assert not torch.equal(start.tables["features"], drawn.tables["features"])
