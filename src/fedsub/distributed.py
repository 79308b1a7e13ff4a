"""Several processes training one run, started by ``torchrun`` (torch.distributed).

torchrun gives each process ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; without them (a plain
``fedsub run``) there is one process and nothing here does anything. Under torchrun every
process draws the same cohort, trains its contiguous share of the members
(``engine/split_cohort.py``) and receives every other share in member order, so every process
holds the same cohort update and applies the same server step: no model is ever broadcast.
Process 0 writes the outputs; the others run silently.

The group is joined once per process (``join``): gloo for the CPU, NCCL for CUDA, where each
process trains on ``cuda:LOCAL_RANK``. A collective that fails (a process died) raises a
``FedsubError`` naming this process, instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from fedsub.errors import ConfigError, FedsubError

if TYPE_CHECKING:
    import torch

# torch is imported by the functions that use it, not here: the command line reads
# ``from_environment`` before every command, and `fedsub --help` / `fedsub list` must not
# pay torch's import (a second or more).

# How long a process waits for the others at a collective before giving up. A process that
# fails exits, which ends its peers' waits at once (gloo's connections close; torchrun stops
# the others); this bounds the wait when a process hangs instead.
TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class Processes:
    """This process's place among the run's processes (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def split(self) -> bool:
        """Whether the cohort is split across several processes."""
        return self.world_size > 1

    @property
    def writes(self) -> bool:
        """Whether this process writes the run's outputs (process 0 only)."""
        return self.rank == 0

    def share(self, members: int) -> range:
        """This process's contiguous share of a cohort's ``members`` positions: shares differ
        in size by at most one, the first ones take the extra members."""
        base, extra = divmod(members, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def __str__(self) -> str:
        return f"process {self.rank} of {self.world_size}"


def from_environment(env: Mapping[str, str] | None = None) -> Processes:
    """The processes torchrun describes in ``env`` (default: this process's environment);
    one process when ``WORLD_SIZE`` is not set. Raises FedsubError naming a malformed
    variable."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env:
        return Processes()
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        text = env.get(name, "0" if name == "LOCAL_RANK" else "")
        if not text.isdigit():
            raise FedsubError(
                f"environment variable {name}={text!r}: expected a whole number "
                "(torchrun sets RANK, WORLD_SIZE and LOCAL_RANK)"
            )
        values[name] = int(text)
    rank, world_size = values["RANK"], values["WORLD_SIZE"]
    if world_size < 1 or rank >= world_size:
        raise FedsubError(
            f"environment variables RANK={rank}, WORLD_SIZE={world_size}: "
            "expected 0 <= RANK < WORLD_SIZE"
        )
    return Processes(rank, world_size, values["LOCAL_RANK"])


def process_device(device: torch.device, processes: Processes | None = None) -> torch.device:
    """The device this process trains on: under torchrun, ``execution.device = "cuda"`` (or
    ``"auto"`` on a GPU machine) is ``cuda:LOCAL_RANK``. Raises ConfigError for a GPU named by
    number (every process would share it) or fewer GPUs than processes on this machine."""
    processes = from_environment() if processes is None else processes
    if not processes.split or device.type != "cuda":
        return device
    if device.index is not None:
        raise ConfigError(
            f'execution.device = "{device}" under torchrun: every process would train on that one '
            'GPU; use "cuda" or "auto" (process i of a machine takes cuda:LOCAL_RANK)'
        )
    import torch

    if processes.local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"execution.device = cuda: {processes} has LOCAL_RANK {processes.local_rank} but this "
            f"machine has {torch.cuda.device_count()} CUDA device(s); start at most that many "
            "processes per machine (torchrun --nproc-per-node)"
        )
    return torch.device("cuda", processes.local_rank)


def joined() -> Processes | None:
    """The processes of the group this process has joined (several), or None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return Processes(dist.get_rank(), dist.get_world_size(), from_environment().local_rank)


def join(device: torch.device) -> Processes:
    """Join torchrun's process group (once; gloo for the CPU, NCCL for ``cuda:LOCAL_RANK``)
    and return this process's place; one process (no torchrun) joins nothing."""
    import torch
    import torch.distributed as dist

    processes = from_environment()
    if not processes.split:
        return processes
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        if dist.get_backend() != backend:
            raise ConfigError(
                f"execution.device = {device} needs the {backend} backend but this run's "
                f"processes already use {dist.get_backend()} (one device type per run)"
            )
        return processes
    on_gpu = backend == "nccl"
    if on_gpu:
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, timeout=TIMEOUT, device_id=device if on_gpu else None)
    except (RuntimeError, ValueError) as error:
        raise FedsubError(f"{processes}: could not join the other processes: {error}") from None
    return processes


def report_to_launcher(message: str) -> None:
    """Under torchrun, ``message`` (the error this process ends with) written where torchrun
    reads a failed process's error (``TORCHELASTIC_ERROR_FILE``, the JSON its own ``record``
    writes): torchrun's failure report, the last thing it prints, then ends with fedsub's
    one-line error as that process's "traceback" instead of a pointer to torch's docs.
    Nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": message, "timestamp": str(int(time.time()))}
    with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as handle:
        json.dump({"message": {"message": message, "extraInfo": info}}, handle)


def leave() -> None:
    """Leave the group (at the end of a command), so the processes exit cleanly; a process
    that never imported torch.distributed has joined nothing."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def collective(what: str) -> Iterator[None]:
    """A failed collective (a process died or timed out) as a FedsubError naming this process."""
    try:
        yield
    except RuntimeError as error:
        where = joined() or from_environment()
        raise FedsubError(
            f"{where}: lost the other processes while {what} ({error}); another process "
            "probably failed: see its message"
        ) from None


def all_gather(value: Any, what: str) -> list[Any]:
    """Every process's ``value`` (picklable; tensors on the CPU), in rank order."""
    import torch.distributed as dist

    group = joined()
    if group is None:
        return [value]
    gathered: list[Any] = [None] * group.world_size
    with collective(what):
        dist.all_gather_object(gathered, value)
    return gathered


def from_first(value: Any, what: str) -> Any:
    """Process 0's ``value`` (picklable), in every process: what one process draws and the
    others must use (e.g. [dp]'s secret, dp/randomness.py). One process: ``value``."""
    import torch.distributed as dist

    if joined() is None:
        return value
    sent = [value]
    with collective(what):
        dist.broadcast_object_list(sent, src=0)
    return sent[0]


def barrier(what: str) -> None:
    """Wait until every process gets here (no-op for one process)."""
    import torch.distributed as dist

    if joined() is None:
        return
    with collective(what):
        dist.barrier()


def any_process(flag: bool, what: str) -> bool:
    """Whether ``flag`` holds in any process: the decision every process takes together."""
    import torch
    import torch.distributed as dist

    group = joined()
    if group is None:
        return flag
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
    value = torch.tensor([int(flag)], device=device)
    with collective(what):
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def agreed(stop_requested: Callable[[], bool]) -> Callable[[], bool]:
    """A stop request every process sees after the same round (a Ctrl-C may reach the
    processes at different moments): the run stops when any process was asked to."""
    return lambda: any_process(stop_requested(), "agreeing whether to stop")
