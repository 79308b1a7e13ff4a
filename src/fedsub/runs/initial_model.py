"""A warm start, for every runtime: round 0's model read from a model file fedsub wrote
(``model.safetensors`` of ``fedsub run``, of a row-sharded torchrun run: one ordinary
safetensors file, sharding/model_file.py; or ``fedsub.train``'s result's ``model_file``)
instead of the seeded initial draw. ``fedsub run --initial-model``, ``fedsub.train(...,
initial_model=)`` and the Flower run config's ``initial-model`` all come here; ``where`` is how
each runtime names its option in errors.

The file is checked against the run's model before round 1, from its header alone (safetensors
reads it without the tensors): every tensor's name, shape and dtype (the configured
``execution.dtype``) must be the model's. Its values then replace the draw's
(``WrittenModel.read_into``: the model's order of tensors, a row-sharded process reading only
its rows). The digest of its bytes joins the run's described identity only when a file is
given (``described``), so a run from the draw keeps the hash it always had and a resumed run
refuses another file. A warm start is not a resume: server state, heat and the round count
start afresh.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open

from fedsub.engine.initial import init_generator, initial_params
from fedsub.engine.schedule import Schedule
from fedsub.errors import FedsubError
from fedsub.files.run_folder import RUN_FILE, file_digest, read_run_file
from fedsub.models.base import Model
from fedsub.numerics.finite import any_nonfinite
from fedsub.runs.run_identity import StartedWith
from fedsub.sharding.initial import drawn_shapes
from fedsub.sharding.model_file import SAFETENSORS_DTYPES, WrittenModel
from fedsub.submodel.params import Params


def dtype_name(dtype: torch.dtype) -> str:
    """As execution.dtype spells it: ``float32``."""
    return str(dtype).removeprefix("torch.")


DTYPE_NAMES = {code: dtype_name(dtype) for dtype, code in SAFETENSORS_DTYPES.items()}


def existing_file(path: str, where: str) -> Path:
    """``path`` when it is a file; a clear error naming the option (``where``) otherwise."""
    file = Path(path)
    if not file.is_file():
        reason = "is not a file" if file.exists() else "does not exist"
        raise FedsubError(f"{where} = {path!r} {reason}; give a model.safetensors fedsub wrote")
    return file


def model_file_digest(path: str, where: str) -> str:
    """The sha256 of the model file's bytes (hashed once per size and modification time)."""
    file = existing_file(path, where)
    stat = file.stat()
    return _digest(str(file), stat.st_size, stat.st_mtime_ns, where)


@lru_cache(maxsize=8)
def _digest(path: str, size: int, mtime_ns: int, where: str) -> str:
    digest = file_digest(Path(path))
    if digest is None:  # removed since model_file_digest looked
        raise FedsubError(f"{where} = {path!r} does not exist")
    return digest


def described(text: str, path: str, where: str) -> str:
    """A run's description (``text``, hashed into its identity) with the digest of the model
    file ``path`` it starts from; ``text`` as it is without one ("": the seeded draw), so a
    run from the draw keeps the hash it had before warm starts existed."""
    if not path:
        return text
    return f"{text}initial-model = 'sha256:{model_file_digest(path, where)}'\n"


def header_of(path: Path, where: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor of the safetensors file ``path``: its dtype (``F32``, ...) and shape."""
    try:
        with safe_open(str(path), "pt") as handle:
            slices = {name: handle.get_slice(name) for name in handle.keys()}  # noqa: SIM118
            return {n: (s.get_dtype(), tuple(s.get_shape())) for n, s in slices.items()}
    except OSError as error:
        raise FedsubError(f"{where} = {str(path)!r}: cannot read it ({error})") from None
    except Exception as error:  # safetensors raises its own SafetensorError
        raise FedsubError(
            f"{where} = {str(path)!r} is not a safetensors file ({error}); give a "
            "model.safetensors fedsub wrote"
        ) from None


def mismatches(
    header: Mapping[str, tuple[str, tuple[int, ...]]], expected: Mapping[str, torch.Tensor]
) -> list[str]:
    """How the file's tensors (``header``) differ from the model's (``expected``): each
    tensor missing, extra, or of another shape or dtype, in name order."""
    found = []
    for name in sorted(set(expected) | set(header)):
        if name not in header:
            want = expected[name]
            found.append(
                f"no tensor {name!r} (expected {dtype_name(want.dtype)} of shape "
                f"{tuple(want.shape)})"
            )
            continue
        if name not in expected:
            found.append(f"tensor {name!r} is not one of the model's")
            continue
        code, shape = header[name]
        want = expected[name]
        if shape != tuple(want.shape):
            found.append(f"tensor {name!r} has shape {shape}, expected {tuple(want.shape)}")
        if code != SAFETENSORS_DTYPES.get(want.dtype):
            found.append(
                f"tensor {name!r} is {DTYPE_NAMES.get(code, code)}, expected "
                f"{dtype_name(want.dtype)} (execution.dtype)"
            )
    return found


def check_model_file(path: Path, expected: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse, naming the file and every tensor that differs, a model file that is not a
    model of these tensors' names, shapes and dtypes, or that holds NaN or Inf (naming each
    such tensor: a run from it would "diverge at round 0")."""
    header = header_of(path, where)
    found = mismatches(header, expected)
    if found:
        raise FedsubError(
            f"{where} = {str(path)!r} does not match the run's model (its config and "
            f"data decide the tensors): {'; '.join(found)}"
        )
    bad = nonfinite_tensors(path, header)
    if bad:
        raise FedsubError(
            f"{where} = {str(path)!r} holds NaN or Inf values in tensor(s) {', '.join(bad)}: "
            "a model to start from must be finite (was it written by a run that diverged?); "
            "give another model file"
        )


CHUNK = 1 << 22  # entries read at a time when checking a model file's values


def nonfinite_tensors(path: Path, header: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """The tensors of the safetensors file ``path`` that hold NaN or Inf, in name order, read
    a block of rows at a time (a table larger than memory is never read whole)."""
    bad = []
    with safe_open(str(path), "pt") as handle:
        for name in sorted(header):
            _, shape = header[name]
            values: Iterable[torch.Tensor]
            if shape:
                rows = max(1, CHUNK // max(1, math.prod(shape[1:])))
                piece = handle.get_slice(name)
                values = (piece[i : i + rows] for i in range(0, shape[0], rows))
            else:
                values = [handle.get_tensor(name)]
            if any(v.is_floating_point() and bool(any_nonfinite([v])) for v in values):
                bad.append(repr(name))
    return bad


def starting_params(model: Model, schedule: Schedule, path: str, where: str) -> Params:
    """The run's round-0 model: the seeded initial draw (``path`` ""), or the model file
    ``path`` after checking it against the draw."""
    drawn = initial_params(model, schedule)
    if not path:
        return drawn
    check_model_file(existing_file(path, where), drawn.state_dict(), where)
    return WrittenModel(Path(path)).read_into(drawn)


RECORD = "initial_model"  # run.json's key for the file an in-process run started from


@dataclass(frozen=True)
class StartFile:
    """The model file an in-process run starts from (``fedsub run --initial-model``,
    ``fedsub.train(initial_model=)``), and how the caller names that option (``where``)."""

    path: str
    where: str = "--initial-model"

    def opened(self) -> str:
        """The digest of the file's bytes, after checking it is a readable safetensors file
        (before a run folder is claimed)."""
        header_of(existing_file(self.path, self.where), self.where)
        return model_file_digest(self.path, self.where)

    def outside(self, folder: Path, replaced_by: str) -> None:
        """Refuse a file inside ``folder`` when the run replaces that folder (``replaced_by``:
        the option that does, ``--overwrite``): the file would go with the run it belongs to
        before every algorithm has read it."""
        file, inside = Path(self.path).resolve(), folder.resolve()
        if file.is_relative_to(inside):
            raise FedsubError(
                f"{self.where} = {self.path!r} is inside {str(folder)!r}, the run folder that "
                f"{replaced_by} replaces: the file would be removed with the old run. Copy it "
                f"out of the folder first (e.g. cp {self.path} start.safetensors) and give "
                f"{self.where} that copy, or write the new run to another folder"
            )

    def check(self, model: Model, schedule: Schedule) -> WrittenModel:
        """The file, checked against ``model`` as ``schedule`` draws it (its names, shapes
        and dtypes: the tables drawn on the meta device where they can be, so a row-sharded
        process never holds them whole), to be read into each algorithm's round-0 model."""
        dtype = schedule.execution.dtype
        drawn = drawn_shapes(lambda g: model.init(g, dtype), lambda: init_generator(schedule.seed))
        check_model_file(existing_file(self.path, self.where), drawn.state_dict(), self.where)
        return WrittenModel(Path(self.path))

    def started_with(self) -> StartedWith:
        """How the run folder keeps the run's config (config.toml), its identity hashing the
        file's digest with it."""
        return StartedWith(
            describe=functools.partial(described, path=self.path, where=self.where),
            settings=f" with {self.where} (the file's bytes)",
        )

    def record(self) -> dict[str, str]:
        """What run.json keeps of it (``initial_model``): where it was and its digest."""
        return {"path": str(Path(self.path).resolve()), "sha256": self.opened()}


def check_resumed_start(folder: Path, start: StartFile | None) -> None:
    """A resume starts from the model its run started from: refused, saying which, when the
    run in ``folder`` started from a model file and ``start`` is none or another file's
    bytes, or from the seeded draw and ``start`` is a file. (The run's identity holds the
    digest too: this says what differs before that check says that something does.)"""
    where = StartFile("").where if start is None else start.where
    kept = read_run_file(folder).get(RECORD)
    if kept is None:
        if start is not None:
            raise FedsubError(
                f"the run in {folder} started from the seeded initial draw, not a model file: "
                f"resume it without {where}"
            )
        return
    if not isinstance(kept, dict) or not isinstance(kept.get("sha256"), str):
        raise FedsubError(f"{folder / RUN_FILE}: {RECORD!r} is not a model file's record")
    was = f"the model file {kept.get('path')!r} (sha256 {kept['sha256']})"
    if start is None:
        raise FedsubError(
            f"the run in {folder} started from {was}: resume it with {where} naming that file "
            "(the same bytes, at any path)"
        )
    given = start.opened()
    if given != kept["sha256"]:
        raise FedsubError(
            f"{where} = {start.path!r} (sha256 {given}) is not the model file the run in "
            f"{folder} started from: {was}; give that file (the same bytes, at any path), or "
            "start a new run"
        )
