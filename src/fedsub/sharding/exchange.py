"""Variable-size all-to-all between the processes, and the bytes it moves.

A ``Route`` is fixed by how many rows this process sends to each rank (its blocks, grouped by
destination in rank order): the counts are exchanged once (``all_to_all_single`` of P
integers), then any tensor laid out in those blocks goes out (``send``) and any tensor laid out
in the received blocks comes back (``reply``), each one ``all_to_all_single`` with split sizes.
gloo (torch 2.x) and NCCL both implement it; NCCL needs the tensors on the process's GPU, gloo
on the CPU, so each exchange moves them to the group's device and back.

``Traffic`` counts the bytes a process sends to the other processes (its own block stays put):
the quantity that grows with the cohort's rows, never with the table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedsub import distributed


@dataclass
class Traffic:
    """Bytes this process sent to others since ``reset``: rows fetched for its members'
    pulls (``fetch``), row deltas routed to owners (``route``), members' dense deltas and
    sizes (``gather``)."""

    fetch: int = 0
    route: int = 0
    gather: int = 0
    rows: int = 0  # table rows this process fetched (its members' unions)

    @property
    def total(self) -> int:
        return self.fetch + self.route + self.gather

    def reset(self) -> None:
        self.fetch = self.route = self.gather = self.rows = 0


def group_device() -> torch.device:
    """Where the process group's collectives take their tensors (NCCL: this GPU)."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sent_bytes(tensor: torch.Tensor, counts: list[int], rank: int) -> int:
    """Bytes of ``tensor``'s blocks (``counts`` rows each, in rank order) not kept here."""
    row = tensor[0].numel() * tensor.element_size() if len(tensor) else 0
    return row * (sum(counts) - counts[rank])


@dataclass(frozen=True)
class Route:
    """This process's block sizes to every rank (``out``) and from every rank (``back``)."""

    out: list[int]
    back: list[int]
    rank: int

    @staticmethod
    def of(counts: list[int], what: str) -> Route:
        """Exchange the block sizes (a collective: every process calls it)."""
        import torch.distributed as dist

        group = distributed.joined()
        assert group is not None, "a Route needs a joined process group"
        device = group_device()
        sent = torch.tensor(counts, dtype=torch.int64, device=device)
        received = torch.empty_like(sent)
        with distributed.collective(what):
            dist.all_to_all_single(received, sent)
        return Route(counts, received.tolist(), group.rank)

    def send(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """``tensor`` (blocks of ``out`` rows) sent out; what the others sent here, in rank
        order (blocks of ``back`` rows)."""
        return _exchange(tensor, self.out, self.back, what)

    def reply(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """The way back: ``tensor`` in blocks of ``back`` rows returns to the senders."""
        return _exchange(tensor, self.back, self.out, what)


def _exchange(tensor: torch.Tensor, out: list[int], back: list[int], what: str) -> torch.Tensor:
    import torch.distributed as dist

    device = group_device()
    source = tensor.to(device).contiguous()
    received = source.new_empty((sum(back), *tensor.shape[1:]))
    with distributed.collective(what):
        dist.all_to_all_single(received, source, back, out)
    return received.to(tensor.device)
