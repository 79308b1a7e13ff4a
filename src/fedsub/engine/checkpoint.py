"""Checkpoints of a training run: every stage's state in its own safetensors file, the rest in
JSON.

Layout: ``<dir>/round-000050/<stage>.safetensors``, one file per stateful stage of the round
(``ServerRound.stages()``: ``model``, ``server``, ``variates`` when SCAFFOLD runs, and any
later one), and ``state.json`` (format, the stage names, round, training seconds so far, the
evaluations so far, and the run it belongs to: run id and config hash, so a resume never
continues another run's checkpoint). Stages are saved and restored generically through
``fedsub.stateful.Stateful``: a new stateful piece needs no code here. A checkpoint is written
into a temporary folder and renamed into place, so a run killed at any moment leaves only whole
checkpoints; the newest ``keep`` are kept (a resume falls back to the older one when the newest
is damaged). Nothing else is needed to resume: every random stream in fedsub is keyed by (seed,
purpose, round, client), so the round number restores them all; under [dp] the key is the
run's secret, itself a stage (``dp_secret``, dp/randomness.py): a checkpoint is private.

A run with row-sharded tables (``execution.table_sharding = "rows"``, fedsub/sharding) writes one
checkpoint folder all the same: process 0 creates the temporary folder, every process writes its
stages into ``shard-<r>-of-<P>/`` in it, and after a barrier process 0 writes ``state.json``
(with ``"shards": P``) and renames the folder into place, so a checkpoint holds every shard of
one round or is not there. It resumes with the same P only (``ShardsMismatch`` names it);
``fedsub reshard`` (engine/reshard.py) cuts it again for another P.

Format 1 (before stages were generic) had fixed ``model``/``server``/``variates`` files and no
stage list in ``state.json``; it still loads, as those three stages (an empty ``variates``
file meaning: no control variates).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from fedsub import distributed
from fedsub.errors import FedsubError
from fedsub.files.atomic_files import create_temp_dir
from fedsub.files.tensor_files import write_tensors
from fedsub.stateful import Stateful

LOG = logging.getLogger("fedsub")

FORMAT = 2
FORMAT_1_STAGES = ("model", "server", "variates")
PREFIX = "round-"
STAGE_NAME = re.compile(r"[a-z][a-z0-9_-]*")  # a stage's name is its file's name

StageStates = dict[str, dict[str, torch.Tensor]]


class ShardsMismatch(FedsubError):
    """A sharded checkpoint resumed by another number of processes (not a damaged one: an
    older checkpoint has the same number)."""


def shard_folder(rank: int, world_size: int) -> str:
    return f"shard-{rank}-of-{world_size}"


@dataclass(frozen=True)
class Checkpoint:
    round: int
    stages: StageStates  # stage name -> its named tensors
    elapsed: float
    history: list[dict]
    path: Path | None = None
    run: dict[str, str] = field(default_factory=dict)  # {"run_id": ..., "config_hash": ...}


def capture(stages: Mapping[str, Stateful]) -> StageStates:
    """Every stage's state now, by stage name (what ``save`` writes)."""
    return {name: stage.state_tensors() for name, stage in stages.items()}


def restore(
    stages: Mapping[str, Stateful], checkpoint: Checkpoint, device: torch.device | None = None
) -> None:
    """Load every stage's saved state into ``stages``, on ``device`` (the model's; files load
    on the CPU). The checkpoint must hold each of them, but for a stage newer than the
    checkpoint that says what its absence means (``load_absent``: privacy/randomness.py); a
    saved stage this run lacks is refused when it holds state (that state would be lost)."""
    where = checkpoint.path or "the checkpoint"
    absent = [n for n in stages if n not in checkpoint.stages and hasattr(stages[n], "load_absent")]
    for name in absent:  # a stage newer than the checkpoint, with a defined meaning of none
        stages[name].load_absent()  # type: ignore[attr-defined]
    stages = {n: s for n, s in stages.items() if n not in absent}
    missing = sorted(set(stages) - set(checkpoint.stages))
    unused = sorted(n for n, t in checkpoint.stages.items() if n not in stages and t)
    if missing or unused:
        problems = []
        if missing:
            problems.append(f"it lacks {', '.join(missing)}")
        if unused:
            problems.append(f"this run has no {', '.join(unused)}")
        raise FedsubError(
            f"{where}: its stages ({', '.join(sorted(checkpoint.stages)) or 'none'}) do not fit "
            f"this run's ({', '.join(sorted(stages))}): {'; '.join(problems)}. Resume with the "
            "configuration that wrote it, or start over."
        )
    for name, stage in stages.items():
        saved = checkpoint.stages[name]
        if device is not None:  # each tensor where the stage keeps it now (a host-placed table)
            current = stage.state_tensors()
            saved = {
                n: v.to(current[n].device if n in current else device) for n, v in saved.items()
            }
        try:
            stage.load_state_tensors(saved)
        except KeyError as error:
            held = ", ".join(sorted(saved)[:4]) + (", ..." if len(saved) > 4 else "")
            raise FedsubError(
                f"{where}: stage {name!r} does not fit this run: it has no tensor "
                f"{error.args[0]!r} (it holds {held or 'none'})"
            ) from None
        except (ValueError, FedsubError) as error:
            raise FedsubError(f"{where}: stage {name!r} does not fit this run: {error}") from None


def _check_names(checkpoint: Checkpoint) -> None:
    for name in checkpoint.stages:
        if not STAGE_NAME.fullmatch(name):
            raise ValueError(f"stage name {name!r} is not {STAGE_NAME.pattern} (a file name)")


def _write_stages(folder: Path, checkpoint: Checkpoint) -> None:
    folder.mkdir(exist_ok=True)
    for name, tensors in checkpoint.stages.items():
        write_tensors(folder / f"{name}.safetensors", tensors)


def _publish(staging: Path, final: Path, checkpoint: Checkpoint, shards: int | None) -> None:
    """Write state.json into ``staging`` and rename it to ``final``."""
    state = {
        "format": FORMAT,
        "stages": sorted(checkpoint.stages),
        "round": checkpoint.round,
        "elapsed": checkpoint.elapsed,
        "history": checkpoint.history,
        "run": checkpoint.run,
        **({"shards": shards} if shards is not None else {}),
    }
    with open(staging / "state.json", "w", encoding="utf-8") as handle:
        json.dump(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)


def _prune(directory: Path, keep: int) -> None:
    for old in sorted(directory.glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def save(directory: Path, checkpoint: Checkpoint, keep: int = 2) -> Path:
    _check_names(checkpoint)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{PREFIX}{checkpoint.round:06d}"
    staging = create_temp_dir(directory, final.name)
    try:
        _write_stages(staging, checkpoint)
        _publish(staging, final, checkpoint, None)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _prune(directory, keep)
    return final


def save_shard(
    directory: Path | None, checkpoint: Checkpoint, processes: distributed.Processes, keep: int = 2
) -> Path:
    """This process's shard of a row-sharded run's checkpoint (a collective: every process
    calls it with its own stages; ``directory`` on process 0, None elsewhere). Returns the
    checkpoint's folder."""
    _check_names(checkpoint)
    staging = final = None
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        final = directory / f"{PREFIX}{checkpoint.round:06d}"
        staging = create_temp_dir(directory, final.name)
    try:
        named = distributed.all_gather(
            None if staging is None else (str(staging), str(final)), "writing a checkpoint"
        )[0]
        if named is None:
            raise FedsubError(f"{processes}: process 0 has no checkpoint folder to write into")
        where = Path(named[0]) / shard_folder(processes.rank, processes.world_size)
        _write_stages(where, checkpoint)
        distributed.barrier("writing a checkpoint")
        if staging is not None and final is not None and directory is not None:
            _publish(staging, final, checkpoint, processes.world_size)
            _prune(directory, keep)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return Path(named[1])


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
        except ShardsMismatch:
            raise
        except FedsubError as error:
            LOG.warning("skipping damaged checkpoint: %s; trying an older one", error)
    return None


def load(path: Path) -> Checkpoint:
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        return Checkpoint(
            round=int(state["round"]),
            stages=_load_stages(path, state),
            elapsed=float(state["elapsed"]),
            history=list(state["history"]),
            path=path,
            run=dict(state.get("run") or {}),
        )
    except FedsubError:
        raise
    except Exception as error:  # safetensors raises its own SafetensorError
        raise FedsubError(f"{path}: not a readable fedsub checkpoint ({error})") from None


def _load_stages(path: Path, state: dict) -> StageStates:
    version = state.get("format")
    if version == 1:
        stages = {name: load_file(str(path / f"{name}.safetensors")) for name in FORMAT_1_STAGES}
        if not stages["variates"]:
            del stages["variates"]  # format 1 wrote an empty file when there were none
        return stages
    if version != FORMAT:
        raise FedsubError(
            f"{path}: checkpoint format {version!r}, expected {FORMAT} (or 1); it was written "
            "by another version of fedsub"
        )
    names = state["stages"]
    if not isinstance(names, list) or not all(
        isinstance(n, str) and STAGE_NAME.fullmatch(n) for n in names
    ):
        raise FedsubError(f"{path}: state.json's stages must be a list of stage names")
    folder = path
    if "shards" in state:  # row-sharded tables: this process's shard
        folder = path / _own_shard(path, state["shards"])
    return {name: load_file(str(folder / f"{name}.safetensors")) for name in names}


def _own_shard(path: Path, shards: object) -> str:
    """The shard folder of this process, when the run has the checkpoint's number of
    processes (torchrun's environment says how many)."""
    processes = distributed.from_environment()
    if shards != processes.world_size:
        reshard = (
            f", or re-shard the run folder first: fedsub reshard RUN_FOLDER --processes "
            f"{processes.world_size}"
            if processes.world_size > 1
            else ""
        )
        raise ShardsMismatch(
            f"{path}: its tables are sharded over {shards} processes "
            f'(execution.table_sharding = "rows"), and this run has {processes.world_size}; '
            f"resume it with torchrun --nproc-per-node {shards}{reshard}"
        )
    return shard_folder(processes.rank, processes.world_size)
