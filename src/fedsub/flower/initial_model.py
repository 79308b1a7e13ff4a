"""The model a Flower run starts from: the seeded initial draw, or (run config
``initial-model``) a model file fedsub wrote: ``model.safetensors`` of ``fedsub run``, of a
row-sharded torchrun run (one ordinary safetensors file, sharding/model_file.py), or
``fedsub.train``'s result's ``model_file``.

The file is checked against the run's model before round 1, from its header alone (safetensors
reads it without the tensors): every tensor's name, shape and dtype (the configured
``execution.dtype``) must be the model's. It is then read by the reader of every model file
fedsub writes (``sharding.model_file.WrittenModel``). The digest of its bytes is part of the
run's description (``FlowerSettings.description``), so a resumed run refuses another file.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open

from fedsub.engine.loop import initial_params
from fedsub.engine.schedule import Schedule
from fedsub.errors import FedsubError
from fedsub.files.run_folder import file_digest
from fedsub.models.base import Model
from fedsub.sharding.model_file import SAFETENSORS_DTYPES, WrittenModel
from fedsub.submodel.params import Params

KEY = "Flower run config: initial-model"


def dtype_name(dtype: torch.dtype) -> str:
    """As execution.dtype spells it: ``float32``."""
    return str(dtype).removeprefix("torch.")


DTYPE_NAMES = {code: dtype_name(dtype) for dtype, code in SAFETENSORS_DTYPES.items()}


def existing_file(path: str) -> Path:
    """``path`` when it is a file; a clear error naming the key otherwise."""
    file = Path(path)
    if not file.is_file():
        reason = "is not a file" if file.exists() else "does not exist"
        raise FedsubError(f"{KEY} = {path!r} {reason}; give a model.safetensors fedsub wrote")
    return file


def model_file_digest(path: str) -> str:
    """The sha256 of the model file's bytes (hashed once per size and modification time)."""
    file = existing_file(path)
    stat = file.stat()
    return _digest(str(file), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=8)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    digest = file_digest(Path(path))
    if digest is None:  # removed since model_file_digest looked
        raise FedsubError(f"{KEY} = {path!r} does not exist")
    return digest


def header_of(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor of the safetensors file ``path``: its dtype (``F32``, ...) and shape."""
    try:
        with safe_open(str(path), "pt") as handle:
            slices = {name: handle.get_slice(name) for name in handle.keys()}  # noqa: SIM118
            return {n: (s.get_dtype(), tuple(s.get_shape())) for n, s in slices.items()}
    except OSError as error:
        raise FedsubError(f"{KEY} = {str(path)!r}: cannot read it ({error})") from None
    except Exception as error:  # safetensors raises its own SafetensorError
        raise FedsubError(
            f"{KEY} = {str(path)!r} is not a safetensors file ({error}); give a "
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


def check_model_file(path: Path, expected: Mapping[str, torch.Tensor]) -> None:
    """Refuse, naming the file and every tensor that differs, a model file that is not a
    model of these tensors' names, shapes and dtypes."""
    found = mismatches(header_of(path), expected)
    if found:
        raise FedsubError(
            f"{KEY} = {str(path)!r} does not match the run's model (its config and "
            f"data decide the tensors): {'; '.join(found)}"
        )


def starting_params(model: Model, schedule: Schedule, path: str) -> Params:
    """The run's round-0 model: the seeded initial draw (``path`` ""), or the model file
    ``path`` after checking it against the draw."""
    drawn = initial_params(model, schedule)
    if not path:
        return drawn
    check_model_file(existing_file(path), drawn.state_dict())
    read = WrittenModel(Path(path)).load().to(schedule.execution.device)
    return Params(  # in the model's order of tables and dense tensors
        {t: read.tables[t] for t in drawn.tables}, {n: read.dense[n] for n in drawn.dense}
    )
