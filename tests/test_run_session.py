"""runs/run_session.py: the run folder's session both runtimes share (``fedsub compare`` and
the Flower ServerApp's out-dir)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fedsub.engine.loop import Interrupted, RunControl
from fedsub.files.run_folder import RUN_FILE, RunIdentity, claim_new
from fedsub.runs.run_session import checkpointed, holding, start_fresh, write_model
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
