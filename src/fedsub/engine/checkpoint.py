"""Checkpoints of a training run: tensors in safetensors files, the rest in JSON.

Layout: ``<dir>/round-000050/{model,server,variates}.safetensors`` and ``state.json`` (round,
training seconds so far, the evaluations so far). A checkpoint is written into a temporary
folder and renamed into place, so a run killed at any moment leaves only whole checkpoints;
the newest ``keep`` are kept. Nothing else is needed to resume: every random stream in fedsub
is keyed by (seed, purpose, round, client), so the round number restores them all.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fedsub.errors import FedsubError

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


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(path))
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def save(directory: Path, checkpoint: Checkpoint, keep: int = 2) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{PREFIX}{checkpoint.round:06d}"
    staging = Path(tempfile.mkdtemp(dir=directory, prefix=f".{final.name}.", suffix=".tmp"))
    try:
        _save_tensors(staging / "model.safetensors", checkpoint.model)
        _save_tensors(staging / "server.safetensors", checkpoint.server)
        _save_tensors(staging / "variates.safetensors", checkpoint.variates)
        state = {
            "format": FORMAT,
            "round": checkpoint.round,
            "elapsed": checkpoint.elapsed,
            "history": checkpoint.history,
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


def latest(directory: Path) -> Path | None:
    found = (
        sorted(p for p in directory.glob(f"{PREFIX}*") if p.is_dir()) if directory.exists() else []
    )
    return found[-1] if found else None


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
        )
    except FedsubError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise FedsubError(f"{path}: not a readable fedsub checkpoint ({error})") from None
