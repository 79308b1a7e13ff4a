"""Checkpoints of a training run: tensors in safetensors files, the rest in JSON.

Layout: ``<dir>/round-000050/{model,server,variates}.safetensors`` and ``state.json`` (round,
training seconds so far, the evaluations so far, and the run it belongs to: run id and config
hash, so a resume never continues another run's checkpoint). A checkpoint is written into a
temporary folder and renamed into place, so a run killed at any moment leaves only whole
checkpoints; the newest ``keep`` are kept (a resume falls back to the older one when the newest
is damaged). Nothing else is needed to resume: every random stream in fedsub is keyed by (seed,
purpose, round, client), so the round number restores them all.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as tensors_to_bytes

from fedsub.atomic_files import create_temp_dir
from fedsub.errors import FedsubError

LOG = logging.getLogger("fedsub")

FORMAT = 1
PREFIX = "round-"


@dataclass(frozen=True)
class Checkpoint:
    round: int
    model: dict[str, torch.Tensor]
    server: dict[str, torch.Tensor]
    variates: dict[str, torch.Tensor]
    elapsed: float
    history: list[dict]
    path: Path | None = None
    run: dict[str, str] = field(default_factory=dict)  # {"run_id": ..., "config_hash": ...}


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    # bytes written by open(), not save_file, so the file's mode follows the umask
    data = tensors_to_bytes({k: v.detach().contiguous().clone() for k, v in tensors.items()})
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def save(directory: Path, checkpoint: Checkpoint, keep: int = 2) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{PREFIX}{checkpoint.round:06d}"
    staging = create_temp_dir(directory, final.name)
    try:
        _save_tensors(staging / "model.safetensors", checkpoint.model)
        _save_tensors(staging / "server.safetensors", checkpoint.server)
        _save_tensors(staging / "variates.safetensors", checkpoint.variates)
        state = {
            "format": FORMAT,
            "round": checkpoint.round,
            "elapsed": checkpoint.elapsed,
            "history": checkpoint.history,
            "run": checkpoint.run,
        }
        with open(staging / "state.json", "w", encoding="utf-8") as handle:
            json.dump(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for old in sorted(directory.glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def all_newest_first(directory: Path) -> list[Path]:
    if not directory.exists():
        return []
    return sorted((p for p in directory.glob(f"{PREFIX}*") if p.is_dir()), reverse=True)


def latest(directory: Path) -> Path | None:
    found = all_newest_first(directory)
    return found[0] if found else None


def newest_intact(directory: Path) -> Checkpoint | None:
    """The newest checkpoint that loads; a damaged newer one (a truncated tensor file, a bad
    state.json) is skipped with a warning naming it. None when there is no intact one."""
    for path in all_newest_first(directory):
        try:
            return load(path)
        except FedsubError as error:
            LOG.warning("skipping damaged checkpoint: %s; trying an older one", error)
    return None


def load(path: Path) -> Checkpoint:
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        if state.get("format") != FORMAT:
            raise FedsubError(
                f"{path}: checkpoint format {state.get('format')!r}, expected {FORMAT}"
            )
        return Checkpoint(
            round=int(state["round"]),
            model=load_file(str(path / "model.safetensors")),
            server=load_file(str(path / "server.safetensors")),
            variates=load_file(str(path / "variates.safetensors")),
            elapsed=float(state["elapsed"]),
            history=list(state["history"]),
            path=path,
            run=dict(state.get("run") or {}),
        )
    except FedsubError:
        raise
    except Exception as error:  # safetensors raises its own SafetensorError
        raise FedsubError(f"{path}: not a readable fedsub checkpoint ({error})") from None
