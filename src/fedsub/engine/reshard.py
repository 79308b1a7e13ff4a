"""Re-shard a row-sharded checkpoint (``execution.table_sharding = "rows"``) from P processes
to P' (``fedsub reshard RUN_FOLDER --processes P'``).

A sharded checkpoint holds ``shard-<r>-of-<P>/<stage>.safetensors`` per process
(engine/checkpoint.py). Which tensors are cut by rows is read from the stages' names:

- the model stage's ``table.<t>`` are the tables (their rows: the shards' rows summed, each
  shard holding exactly its range of ``RowPartition(rows, P)``); ``dense.<d>`` are replicated;
- in any other stage, per-parameter state is named ``<prefix>.<parameter>`` (the server
  optimizers' convention, e.g. lazy Adam's ``adam.lazy.m.<t>``): a tensor named after a table
  is that table's per-row state, cut like it; every other tensor is replicated.

Row-cut tensors are concatenated in rank order (the whole tensor) and cut again by the same
rule for P'; replicated ones must be equal in every shard and are copied. FedSubAvg's heat
coefficients are not in a checkpoint (a resume computes them again), nor is any random state
(every stream is keyed by seed, round and client). The new checkpoint is written into a
temporary folder and renamed into place; the source is only read (``reshard``) or replaced
after the new one is whole (``reshard_run``: every intact checkpoint of each algorithm, so a
resume that falls back to an older one finds it re-sharded too).

P' = 1 is refused: a one-process run refuses ``table_sharding = "rows"`` (nothing to shard
over), and the run's identity is the hash of its config.toml, so continuing it in one process
would be another run (another config), not a resume.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from fedsub.engine import checkpoint as ckpt
from fedsub.errors import FedsubError
from fedsub.files.atomic_files import create_temp_dir
from fedsub.files.run_folder import RUN_FILE, read_run_file
from fedsub.files.tensor_files import write_tensors
from fedsub.sharding.partition import RowPartition

LOG = logging.getLogger("fedsub")
Shard = dict[str, dict[str, torch.Tensor]]  # stage -> its tensors, in one shard


@dataclass(frozen=True)
class ShardedCheckpoint:
    """A sharded checkpoint as read: its state.json and every shard's stages, in rank order."""

    path: Path
    state: dict
    shards: list[Shard]


def read_sharded(path: Path) -> ShardedCheckpoint:
    """Every shard of the checkpoint folder ``path``; a missing or unreadable piece is refused
    naming its file."""
    state_file = path / "state.json"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise FedsubError(f"{state_file}: not a readable checkpoint state ({error})") from None
    if not isinstance(state, dict) or state.get("format") != ckpt.FORMAT:
        raise FedsubError(f"{state_file}: not a format-{ckpt.FORMAT} fedsub checkpoint")
    processes = state.get("shards")
    if "shards" not in state:
        raise FedsubError(
            f'{state_file}: not a sharded checkpoint (no "shards": it was written by a run '
            'without execution.table_sharding = "rows")'
        )
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise FedsubError(f'{state_file}: "shards" is {processes!r}, expected a count >= 1')
    names = state.get("stages")
    if not isinstance(names, list) or not all(
        isinstance(n, str) and ckpt.STAGE_NAME.fullmatch(n) for n in names
    ):
        raise FedsubError(f"{state_file}: its stages must be a list of stage names")
    shards = [_read_shard(path / ckpt.shard_folder(r, processes), names) for r in range(processes)]
    return ShardedCheckpoint(path, state, shards)


def _read_shard(folder: Path, names: list[str]) -> Shard:
    stages = {}
    for name in names:
        file = folder / f"{name}.safetensors"
        if not file.is_file():
            raise FedsubError(f"{file}: missing (an incomplete sharded checkpoint)")
        try:
            stages[name] = load_file(str(file))
        except Exception as error:  # safetensors raises its own SafetensorError
            raise FedsubError(f"{file}: not a readable tensor file ({error})") from None
    return stages


def table_rows(checkpoint: ShardedCheckpoint) -> dict[str, int]:
    """Each table's rows, from the model stage's ``table.<t>`` shards."""
    if "model" not in checkpoint.state["stages"]:
        raise FedsubError(f"{checkpoint.path}: a sharded checkpoint without a model stage")
    first = checkpoint.shards[0]["model"]
    return {
        key[len("table.") :]: sum(len(s["model"].get(key, ())) for s in checkpoint.shards)
        for key in first
        if key.startswith("table.")
    }


def owner_table(stage: str, name: str, tables: dict[str, int], dense: set[str]) -> str | None:
    """The table whose rows tensor ``name`` of ``stage`` is cut by, or None (replicated)."""
    if stage == "model":
        return name[len("table.") :] if name.startswith("table.") else None
    named = [p for p in (*tables, *dense) if name == p or name.endswith(f".{p}")]
    if not named:
        return None
    owner = max(named, key=len)  # the longest: dense "head.t" beside table "t" is dense
    if owner in tables and owner in dense:
        raise FedsubError(f"stage {stage!r}: tensor {name!r} names both a table and a dense one")
    return owner if owner in tables else None


def resharded(checkpoint: ShardedCheckpoint, processes: int) -> list[Shard]:
    """The checkpoint's stages cut for ``processes`` processes (a pure function)."""
    tables = table_rows(checkpoint)
    dense = {k[len("dense.") :] for k in checkpoint.shards[0]["model"] if k.startswith("dense.")}
    out: list[Shard] = [{} for _ in range(processes)]
    for stage in checkpoint.state["stages"]:
        for r in range(processes):
            out[r][stage] = {}
        for name in _same_names(checkpoint, stage):
            parts = [s[stage][name] for s in checkpoint.shards]
            where = f"{checkpoint.path}: stage {stage!r}, tensor {name!r}"
            table = owner_table(stage, name, tables, dense)
            if table is None:
                value = _replicated(parts, where)
                for r in range(processes):
                    out[r][stage][name] = value
                continue
            whole = _rows_of(parts, RowPartition(tables[table], len(parts)), where)
            new = RowPartition(tables[table], processes)
            for r in range(processes):
                cut = new.range_of(r)
                out[r][stage][name] = whole[cut.start : cut.stop].clone()
    return out


def _same_names(checkpoint: ShardedCheckpoint, stage: str) -> list[str]:
    names = sorted(checkpoint.shards[0][stage])
    for r, shard in enumerate(checkpoint.shards):
        if sorted(shard[stage]) != names:
            folder = ckpt.shard_folder(r, len(checkpoint.shards))
            raise FedsubError(
                f"{checkpoint.path / folder / stage}.safetensors: its tensors "
                f"({', '.join(sorted(shard[stage]))}) are not shard 0's ({', '.join(names)})"
            )
    return names


def _replicated(parts: list[torch.Tensor], where: str) -> torch.Tensor:
    for r, part in enumerate(parts[1:], start=1):
        same = part.dtype == parts[0].dtype and part.shape == parts[0].shape
        if not same or not torch.equal(part, parts[0]):
            raise FedsubError(f"{where}: replicated, but shard {r} differs from shard 0")
    return parts[0]


def _rows_of(parts: list[torch.Tensor], partition: RowPartition, where: str) -> torch.Tensor:
    for r, part in enumerate(parts):
        rows = len(partition.range_of(r))
        if part.dim() == 0 or part.shape[0] != rows or part.shape[1:] != parts[0].shape[1:]:
            raise FedsubError(
                f"{where}: shard {r} has shape {tuple(part.shape)}, expected {rows} rows (its "
                f"range of {partition.rows} rows cut over {partition.world_size} processes)"
            )
        if part.dtype != parts[0].dtype:
            raise FedsubError(f"{where}: shard {r} is {part.dtype}, shard 0 {parts[0].dtype}")
    return torch.cat(parts)


def _check_processes(processes: int) -> None:
    if processes < 2:
        raise FedsubError(
            f"--processes {processes}: a row-sharded run needs 2 or more processes (one "
            'process refuses execution.table_sharding = "rows", and the run\'s config, which '
            "its identity is the hash of, says rows)"
        )


def _write(checkpoint: ShardedCheckpoint, shards: list[Shard], staging: Path) -> None:
    """The new shards, then state.json (the old one with the new count), into ``staging``."""
    for r, shard in enumerate(shards):
        folder = staging / ckpt.shard_folder(r, len(shards))
        folder.mkdir()
        for stage, tensors in shard.items():
            write_tensors(folder / f"{stage}.safetensors", tensors)
    with open(staging / "state.json", "w", encoding="utf-8") as handle:
        json.dump({**checkpoint.state, "shards": len(shards)}, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _staged(checkpoint: ShardedCheckpoint, folder: Path, processes: int) -> Path:
    """``checkpoint`` re-sharded into a new temporary folder in ``folder`` (removed on
    failure)."""
    _check_processes(processes)
    shards = resharded(checkpoint, processes)
    staging = create_temp_dir(folder, checkpoint.path.name)
    try:
        _write(checkpoint, shards, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def reshard(source: Path, destination: Path, processes: int) -> Path:
    """Write the sharded checkpoint ``source`` again, for ``processes`` processes, as the new
    folder ``destination`` (which must not exist). ``source`` is only read."""
    _check_processes(processes)
    if destination.exists():
        raise FedsubError(f"{destination}: exists; re-sharding writes a new folder")
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = _staged(read_sharded(source), destination.parent, processes)
    try:
        os.replace(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return destination


def reshard_in_place(checkpoint: ShardedCheckpoint, processes: int) -> None:
    """Replace the checkpoint's folder by itself re-sharded: the new one is written beside
    it, then the old one is moved aside to a temporary name, the new one renamed into its
    place, and the old one removed."""
    path = checkpoint.path
    staging = _staged(checkpoint, path.parent, processes)
    aside = create_temp_dir(path.parent, path.name)
    try:
        os.replace(path, aside)
        os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def reshard_folder(directory: Path, processes: int) -> list[Path]:
    """Re-shard every checkpoint in ``directory`` (one algorithm's ``checkpoints/``) whose
    every shard reads, so a resume that falls back to an older one finds it re-sharded too;
    a damaged one is left as it is (a resume skips it too), with a warning naming it. Oldest
    first: a kill while the newest is replaced leaves the older ones already re-sharded."""
    done = []
    for path in reversed(ckpt.all_newest_first(directory)):
        try:
            checkpoint = read_sharded(path)
        except FedsubError as error:
            LOG.warning("skipping checkpoint: %s", error)
            continue
        reshard_in_place(checkpoint, processes)
        done.append(path)
    return done


def reshard_run(folder: Path, processes: int) -> list[Path]:
    """Re-shard the intact checkpoints of every algorithm of the run folder ``folder`` for
    ``processes`` processes; returns the checkpoints re-sharded. The run's own files
    (run.json, config.toml) name no process count: nothing else changes."""
    _check_processes(processes)
    if not folder.is_dir():
        raise FedsubError(f"RUN_FOLDER {folder}: not a folder (expected a run folder)")
    if not (folder / RUN_FILE).is_file():
        raise FedsubError(f"RUN_FOLDER {folder}: not a run folder (it has no {RUN_FILE})")
    read_run_file(folder)  # and its run.json reads
    done = [
        path
        for sub in sorted(folder.iterdir())
        if (sub / "checkpoints").is_dir()
        for path in reshard_folder(sub / "checkpoints", processes)
    ]
    if not done:
        raise FedsubError(
            f"{folder}: no intact sharded checkpoint in any <algorithm>/checkpoints/ (a run "
            'with execution.table_sharding = "rows" and train.checkpoint_every writes them)'
        )
    return done
