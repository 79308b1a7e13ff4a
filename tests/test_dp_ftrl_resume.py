"""A DP-FTRL run with the windowed private selection (dp/ftrl.py, ``dp.selection_window`` = w >
1) stopped mid-window and mid-refresh resumes to the uninterrupted run bit for bit: the model
file and every epsilon line. The window being gathered (each read window's rounds' touched rows
and histograms) and the selection serving the current windows are checkpoint state (the
``dp_ftrl`` stage); without them the resumed run selected again from the rounds it saw.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsub.config import Config
from fedsub.dp import selection
from fedsub.dp.ftrl import FtrlMechanism
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.runs import experiment
from fedsub.runs.run_setup import dp_of

from .test_dp import SMALL
from .test_dp_secret import straight_and_stopped

# 8 rounds, windows of 2 (window 0: rounds 1-2, 1: 3-4, 2: 5-6, 3: 7-8); refresh 2: the
# selection made at round 3 from window 0 serves windows 1 and 2, the one made at round 7 reads
# window 2; at most 6 rows a selection
WINDOWED = [
    "train.rounds=8",
    "eval.every=1",
    "train.checkpoint_every=0",
    "train.algorithms=['fedsubavg']",
    "dp.noise_multiplier=0.8",
    "dp.clip=0.5",
    "dp.rows='private'",
    "dp.min_separation=2",
    "dp.selection_window=2",
    "dp.selection_refresh=2",
    "dp.selection_max_rows=6",
    "dp.selection_threshold=1.0",
]
BLT = ["dp.mechanism='ftrl-blt'", "dp.blt_buffers=2"]
MECHANISMS = {"ftrl-tree": ["dp.mechanism='ftrl-tree'"], "ftrl-blt": BLT}


def lines(folder: Path) -> list[str]:
    """metrics.jsonl without the wall-clock seconds: every round's metrics and epsilon."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").open()]
    return [json.dumps({k: v for k, v in r.items() if k != "elapsed"}) for r in records]


@pytest.mark.parametrize("stop_after", [5, 3])
@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_a_windowed_run_stopped_mid_window_resumes_bit_for_bit(tmp_path, mechanism, stop_after):
    """Stopped after round 5 (window 2's first round: its histogram half gathered, the
    selection from round 3 still serving it) or 3 (window 1's first round, its selection just
    made), resumed in its folder: the model file and the epsilon lines of the same secret run
    uninterrupted, byte for byte."""
    if mechanism == "ftrl-blt":
        pytest.importorskip("jax_privacy", reason="ftrl-blt's strategy is jax-privacy's")
    c = Config.from_toml(None, [*SMALL, *WINDOWED, *MECHANISMS[mechanism]])
    straight_and_stopped(c, tmp_path, stop_after)
    folder = tmp_path / "stopped" / "fedsubavg" / "checkpoints"
    saved = checkpoint_lib.load(checkpoint_lib.latest(folder))  # type: ignore[arg-type]
    assert saved.round == stop_after
    held = saved.stages["dp_ftrl"]
    assert any(n.startswith("selection.") for n in held)  # the selection serving the window
    assert any(n.startswith("window.") for n in held) == (stop_after == 5)  # window 2 read
    experiment.compare(c, tmp_path / "stopped", resume=True)
    a, b = (tmp_path / run / "fedsubavg" for run in ("straight", "stopped"))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert lines(a) == lines(b) and len(lines(b)) == 9  # rounds 0 to 8, epsilon on each
    assert all("epsilon" in json.loads(x) for x in lines(b)[1:])
    # the un-noised window histograms are kept only in the checkpoints (private, as the secret)
    kept = [p.relative_to(tmp_path) for p in tmp_path.rglob("dp_ftrl.safetensors")]
    assert kept and all("checkpoints" in p.parts for p in kept)


def mechanism() -> FtrlMechanism:
    config = Config.from_toml(
        None,
        [
            "dp.mechanism='ftrl-tree'",
            "dp.noise_multiplier=1.0",
            "dp.randomness='seeded'",
            "dp.min_separation=2",
            "dp.selection_window=2",
        ],
    )
    settings = dp_of(config, 3000)
    assert settings is not None
    # table names that look like the stage's own tensor names
    return FtrlMechanism(settings, {"w.rows": 100, "selection.w": 50}, np.ones(3000))


def test_the_window_state_round_trips_and_an_older_checkpoint_still_loads() -> None:
    """Tables named like the stage's tensors do not confuse the loader; a checkpoint written
    before the window state was kept (only ``{table}.rows`` / ``{table}.rounds``) loads as
    before: the last rounds, no window state."""
    before = mechanism()
    before.selected = {"w.rows": (np.array([3, 7]), np.array([2, 4]))}
    before.window_parts = {
        "w.rows": {
            5: (torch.tensor([1, 3]), torch.tensor([2.0, 1.0])),
            6: (torch.tensor([3]), torch.tensor([0.5])),
        },
        "selection.w": {5: (torch.zeros(0, dtype=torch.int64), torch.zeros(0))},
    }
    chosen = selection.Selection(
        torch.tensor([3, 9]), torch.tensor([1, -1]), torch.tensor([4.5, 2.0], dtype=torch.float64)
    )
    before.window_selected = {("w.rows", 2): chosen}
    after = mechanism()
    after.load_state_tensors(before.state_tensors())
    assert {t: [a.tolist() for a in v] for t, v in after.selected.items()} == {
        "w.rows": [[3, 7], [2, 4]]
    }
    assert set(after.window_parts) == set(before.window_parts)
    for table, parts in before.window_parts.items():
        assert sorted(after.window_parts[table]) == sorted(parts)
        for r, (rows, heat) in parts.items():
            got_rows, got_heat = after.window_parts[table][r]
            assert torch.equal(got_rows, rows) and torch.equal(got_heat, heat)
    assert list(after.window_selected) == [("w.rows", 2)]
    got = after.window_selected[("w.rows", 2)]
    for name in ("rows", "touched_position", "noisy_heat"):
        assert torch.equal(getattr(got, name), getattr(chosen, name)), name
    old = {n: v for n, v in before.state_tensors().items() if n.startswith("last.")}
    legacy = {n.removeprefix("last."): v for n, v in old.items()}  # the older names
    again = mechanism()
    again.load_state_tensors(legacy)
    assert list(again.last_rounds("w.rows", np.array([3, 5, 7]))) == [2, 0, 4]
    assert again.window_parts == {} and again.window_selected == {}


def test_the_checkpoint_holds_the_rows_selected_in_a_late_round() -> None:
    """The rows selected in the round being checkpointed (pending until the next round) are
    saved with their last round, however late that round is (here round 10,000)."""
    before = mechanism()
    before.selected = {"w.rows": (np.array([3]), np.array([2]))}
    before.pending_rows = (10_000, {"w.rows": (np.array([5, 7]), np.array([10_000, 10_000]))})
    after = mechanism()
    after.load_state_tensors(before.state_tensors())
    assert list(after.last_rounds("w.rows", np.array([3, 5, 7]))) == [2, 10_000, 10_000]


@pytest.mark.parametrize(
    "name", ["bogus.w.rows", "window.w.rows", "last..rows", "selection.w.rows"]
)  # an unknown kind, a window part without its round, no table, a selection without its key
def test_a_stage_tensor_it_never_writes_is_refused_by_name(name: str) -> None:
    tensors = {"format": torch.tensor(2), name: torch.zeros(1, dtype=torch.int64)}
    with pytest.raises(ValueError, match=f"the dp_ftrl stage holds {name!r}"):
        mechanism().load_state_tensors(tensors)


def test_a_checkpoint_without_the_window_state_still_resumes(tmp_path):
    """A run folder whose checkpoint holds only the last rounds under their older names (as
    fedsub wrote before it kept the window) resumes as it did then: it selects again from the
    rounds it sees, so its model differs from the uninterrupted run's while every epsilon line
    is the same (the selection's post-processing does not move the accounting)."""
    from safetensors.torch import load_file, save_file

    c = Config.from_toml(None, [*SMALL, *WINDOWED, *MECHANISMS["ftrl-tree"]])
    straight_and_stopped(c, tmp_path, 5)
    newest = checkpoint_lib.latest(tmp_path / "stopped" / "fedsubavg" / "checkpoints")
    assert newest is not None
    stage = newest / "dp_ftrl.safetensors"
    held = load_file(str(stage))
    older = {n.removeprefix("last."): v for n, v in held.items() if n.startswith("last.")}
    assert older and len(older) < len(held)  # the window state dropped
    save_file(older, str(stage))
    experiment.compare(c, tmp_path / "stopped", resume=True)
    a, b = (tmp_path / run / "fedsubavg" for run in ("straight", "stopped"))
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    epsilons = [[json.loads(x).get("epsilon") for x in lines(f)] for f in (a, b)]
    assert epsilons[0] == epsilons[1] and len(epsilons[1]) == 9
