"""A Flower out-dir written before Flower ran the engine's round loop resumes: its run.json
holds only the hash of the config as that fedsub wrote it (here with a key missing, as a run
written before the key was added), its checkpoints hold the strategy's history (evaluations
and round records as ``{"evaluation": r, "metrics": m}`` / ``{"record": ...}``, no elapsed
time). The resumed ServerApp ends with the uninterrupted run's model, records and
evaluations."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from flwr.app import Context, RecordDict
from safetensors.torch import load_file

from fedsub import config as config_lib
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.errors import FedsubError
from fedsub.files.run_folder import hash_config
from fedsub.flower.settings import FlowerSettings, Output, Replies
from fedsub.moved_keys import text_before_move

from .flower_rounds import recorded
from .test_flower import OVERRIDES
from .test_flower_heat_exchange import AppGrid

pytestmark = pytest.mark.usefixtures("flower_task_identity")


def serve(settings: FlowerSettings) -> list[int]:
    """The ServerApp's run on six in-process nodes; the rounds of the train messages sent."""
    from flwr.app import MessageType

    from fedsub.flower.apps import make_client_app, make_server_app

    grid = AppGrid(make_client_app(settings), 6)
    sent = recorded(grid)
    make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
    return [int(m.metadata.group_id) for m in sent if m.metadata.message_type == MessageType.TRAIN]


def as_the_old_strategy_wrote_it(out, description: str) -> None:
    """Rewrite the out-dir's run.json and checkpoints as fedsub wrote them before Flower ran
    the engine's loop: the config hash of ``description``, no config text in run.json, the
    strategy's history entries, elapsed 0."""
    run = json.loads((out / "run.json").read_text())
    del run["config"]
    run["config_hash"] = hash_config(description)
    (out / "run.json").write_text(json.dumps(run))
    for path in checkpoint_lib.all_newest_first(out / "checkpoints"):
        saved = checkpoint_lib.load(path)
        history = [
            {"evaluation": e["round"], "metrics": e["metrics"]}
            for e in saved.history
            if "record" not in e
        ] + [e for e in saved.history if "record" in e]
        stamp = {"run_id": "flower", "config_hash": hash_config(description)}
        old = checkpoint_lib.Checkpoint(saved.round, saved.stages, 0.0, history, run=stamp)
        checkpoint_lib.save(out / "old", old, keep=10)
    for path in checkpoint_lib.all_newest_first(out / "checkpoints"):
        for file in path.iterdir():
            file.unlink()
        path.rmdir()
    (out / "old").rename(out / "checkpoints")
    (out / "model.safetensors").unlink()
    (out / "flower-result.json").unlink()


def test_a_flower_run_written_before_the_one_loop_resumes_to_the_same_results(tmp_path, caplog):
    overrides = (*OVERRIDES, "train.algorithms=['fedsubavg-adam']")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    options = {"overrides": overrides, "replies": Replies(round_timeout=30.0), "eval_every": 1}
    serve(FlowerSettings(**options, output=Output(out_dir=str(whole))))
    serve(FlowerSettings(**options, output=Output(out_dir=str(cut), checkpoint_every=1)))
    settings = FlowerSettings(**options, output=Output(out_dir=str(cut)))
    config = config_lib.load(None, overrides)
    written = config_lib.to_toml(config)
    older = "\n".join(line for line in written.splitlines() if "divergence_factor" not in line)
    assert older != written  # the key that "did not exist yet"
    as_the_old_strategy_wrote_it(cut, settings.description(older, "fedsubavg-adam"))
    assert checkpoint_lib.newest_intact(cut / "checkpoints").round == 2  # type: ignore[union-attr]

    with caplog.at_level(logging.WARNING, logger="fedsub"):
        trained = serve(FlowerSettings(**options, output=Output(out_dir=str(cut), resume=True)))
    assert trained == [3, 3, 3]  # it went on after round 2
    assert "taken as that run's" in caplog.text  # the config cannot be checked: said so
    for name, value in load_file(whole / "model.safetensors").items():
        torch.testing.assert_close(
            load_file(cut / "model.safetensors")[name], value, rtol=0, atol=0
        )
    before = json.loads((whole / "flower-result.json").read_text())
    after = json.loads((cut / "flower-result.json").read_text())
    assert [r["round"] for r in after["rounds"]] == [1, 2, 3]
    assert sorted(after["evaluations"]) == sorted(before["evaluations"]) == ["1", "2", "3"]
    assert after["evaluations"] == before["evaluations"]


def test_a_resume_checks_the_config_kept_in_run_json(tmp_path):
    """A run written now keeps its config as written: resuming it with another config, or
    after its text was edited, is refused."""
    out = tmp_path / "out"
    options = {"replies": Replies(round_timeout=30.0)}
    serve(
        FlowerSettings(
            overrides=OVERRIDES, **options, output=Output(out_dir=str(out), checkpoint_every=1)
        )
    )
    other = (*OVERRIDES, "train.lr=0.3")
    with pytest.raises(FedsubError, match=r"is not the one in .*run\.json"):
        serve(
            FlowerSettings(
                overrides=other, **options, output=Output(str(out), checkpoint_every=1, resume=True)
            )
        )
    run = json.loads((out / "run.json").read_text())
    run["config"] = run["config"].replace("seed =", "seed = 1 #")
    (out / "run.json").write_text(json.dumps(run))
    with pytest.raises(FedsubError, match="was either edited"):
        serve(
            FlowerSettings(
                overrides=OVERRIDES,
                **options,
                output=Output(str(out), checkpoint_every=1, resume=True),
            )
        )


def test_a_flower_run_written_before_keys_left_train_resumes_checked(tmp_path, caplog):
    """An out-dir stamped with the config as written before keys moved to [execution],
    [privacy] and [masking] (its only record of the config) is checked, not taken on trust."""
    overrides = (*OVERRIDES, "train.algorithms=['fedsubavg-adam']")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    options = {"overrides": overrides, "replies": Replies(round_timeout=30.0), "eval_every": 1}
    serve(FlowerSettings(**options, output=Output(out_dir=str(whole))))
    serve(FlowerSettings(**options, output=Output(out_dir=str(cut), checkpoint_every=1)))
    settings = FlowerSettings(**options, output=Output(out_dir=str(cut)))
    before_move = text_before_move(config_lib.to_toml(config_lib.load(None, overrides)))
    assert "[execution]" not in before_move and "dtype" in before_move
    as_the_old_strategy_wrote_it(cut, settings.description(before_move, "fedsubavg-adam"))

    with caplog.at_level(logging.WARNING, logger="fedsub"):
        trained = serve(FlowerSettings(**options, output=Output(out_dir=str(cut), resume=True)))
    assert trained == [3, 3, 3]
    assert "taken as that run's" not in caplog.text  # checked: no warning
    for name, value in load_file(whole / "model.safetensors").items():
        torch.testing.assert_close(
            load_file(cut / "model.safetensors")[name], value, rtol=0, atol=0
        )
