"""Who is in a federation whose clients come and go (a Flower deployment's nodes): the
registered clients by partition, which of them the heat counts, and which can train now.

A client registers with its partition id (the client's key), its sample count and its index
sets S(k) (``Registration``). Registrations are kept by partition, so a replacement node (same
partition, new node id) takes its partition over. Departed nodes keep their registration:
their data still exist and count in the heat n_m and in N (the population is every client that
ever registered), but they are not sampled while offline.

``counted`` are the partitions in the current heat coefficients: a partition that registers
later (or re-registers with other S(k) or counts) joins ``counted`` at the next coefficient
refresh (``Membership.refresh``), and is sampled only from then on, so no round ever weights a
row by a heat that leaves out one of its clients.

``Membership`` is a checkpoint stage (``fedsub.stateful.Stateful``): a resumed server knows
the population without asking the nodes again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedsub.data.federated import ClientSizes
from fedsub.data.ragged import Ragged
from fedsub.files.tensor_files import unsigned_ids, unsigned_ids_tensor
from fedsub.submodel.index import SubmodelIndex


@dataclass(frozen=True)
class Registration:
    """One node's answer to the query: its partition, sample count and S(k) per table."""

    partition: int
    node: int
    examples: int
    rows: dict[str, np.ndarray]

    def same_data(self, other: Registration) -> bool:
        """Same count and rows; a table a registration does not name has no rows (a private
        registration names none, its checkpointed copy names every table, empty)."""
        empty = np.zeros(0, dtype=np.int64)
        return self.examples == other.examples and all(
            np.array_equal(self.rows.get(t, empty), other.rows.get(t, empty))
            for t in self.rows.keys() | other.rows.keys()
        )


class Membership:
    """The registered clients by partition, their nodes, and the nodes dropped this run."""

    def __init__(self, tables: dict[str, int]) -> None:
        self.tables = tables  # table name -> rows
        self.registered: dict[int, Registration] = {}
        self.counted: list[int] = []  # partitions in the heat coefficients, sorted
        self.dropped: set[int] = set()  # node ids that failed a round: not sampled again

    # --- registration ------------------------------------------------------------------------
    def register(self, registration: Registration) -> None:
        """Add a node's registration; a known partition is taken over by the new node, and
        waits for the next refresh only when its data differ from those counted."""
        k = registration.partition
        before = self.registered.get(k)
        self.registered[k] = registration
        self.dropped.discard(registration.node)  # it answered: alive again
        if before is not None and k in self.counted and not before.same_data(registration):
            self.counted.remove(k)  # its heat changed: counted again at the next refresh

    def drop(self, node: int) -> None:
        """A node that did not answer: leave it out of the next rounds, until it answers a
        registration query again (a restarted SuperNode registers under a new node id)."""
        self.dropped.add(node)

    def forget_offline(self, online: set[int]) -> None:
        """A dropped node that went offline may come back (same node id): it is then sampled
        again, as its partition's node."""
        self.dropped &= online

    def node_of(self, partition: int) -> int:
        return self.registered[partition].node

    # --- the population the coefficients see ------------------------------------------------
    def stale(self) -> bool:
        """Whether registrations changed since the last refresh."""
        return self.counted != sorted(self.registered)

    def refresh(self) -> None:
        """Count every registered partition (the coefficients are rebuilt by the caller)."""
        self.counted = sorted(self.registered)

    def sizes(self) -> ClientSizes:
        counts = [self.registered[k].examples for k in self.counted]
        return ClientSizes(dict(self.tables), np.array(counts, dtype=np.int64))

    def index(self) -> SubmodelIndex:
        """S(k) of the counted clients, client j being partition ``counted[j]``."""
        return SubmodelIndex(
            {
                t: Ragged.from_lists([self.registered[k].rows[t] for k in self.counted])
                for t in self.tables
            },
            {},
        )

    def available(self, online: set[int]) -> np.ndarray:
        """Positions (in ``counted``) of the clients whose node is online and not dropped."""
        return np.array(
            [
                j
                for j, k in enumerate(self.counted)
                if (node := self.registered[k].node) in online and node not in self.dropped
            ],
            dtype=np.int64,
        )

    # --- checkpoint stage ----------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        partitions = sorted(self.registered)
        regs = [self.registered[k] for k in partitions]
        tensors = {
            "partitions": torch.tensor(partitions, dtype=torch.int64),
            "nodes": unsigned_ids_tensor([r.node for r in regs]),
            "examples": torch.tensor([r.examples for r in regs], dtype=torch.int64),
            "counted": torch.tensor(self.counted, dtype=torch.int64),
            "dropped": unsigned_ids_tensor(sorted(self.dropped)),
        }
        for t in self.tables:
            rows = Ragged.from_lists([r.rows.get(t, np.zeros(0, dtype=np.int64)) for r in regs])
            tensors[f"rows.{t}"] = torch.from_numpy(rows.values)
            tensors[f"offsets.{t}"] = torch.from_numpy(rows.offsets)
        return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        missing = sorted({f"rows.{t}" for t in self.tables} - set(tensors))
        if missing:
            raise ValueError(f"the population has no rows of table(s) {', '.join(missing)}")
        partitions = tensors["partitions"].tolist()
        nodes, examples = unsigned_ids(tensors["nodes"]), tensors["examples"].tolist()
        registered = {}
        for j, k in enumerate(partitions):
            rows = {}
            for t in self.tables:
                offsets = tensors[f"offsets.{t}"]
                rows[t] = tensors[f"rows.{t}"][offsets[j] : offsets[j + 1]].numpy().copy()
            registered[k] = Registration(k, nodes[j], examples[j], rows)
        self.registered = registered
        self.counted = tensors["counted"].tolist()
        self.dropped = set(unsigned_ids(tensors["dropped"]))


class PositionNodes(Mapping[int, int]):
    """Node id of the client at each position of ``membership.counted`` (a cohort's ids),
    read when asked (a replacement node takes its partition's position)."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership

    def __getitem__(self, j: int) -> int:
        return self.membership.node_of(self.membership.counted[j])

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.membership.counted)))

    def __len__(self) -> int:
        return len(self.membership.counted)
