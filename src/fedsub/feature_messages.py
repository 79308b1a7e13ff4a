"""A feature's own messages between the server and its nodes, in fedsub's terms, for a runtime
to carry without naming the feature (docs/develop/extending.md, "A feature's Flower protocol").

A feature that talks to the nodes itself (privacy's heat exchange and secure row sums) writes
its protocol against these types alone, in its own package:

- ``Fields``: one message's fields, both ways: numbers, text, bytes and lists of them;
- the node's side: an ``Answer`` from a request's fields and the node's ``NodeState`` (what it
  keeps between messages, never sent) to the reply's fields;
- the server's side: it asks through an ``Ask`` (the requests' fields by node, the stage's
  name) and gets the valid replies' fields by node;
- ``NodeFacts``: what a node knows of itself that its answers may read;
- ``Carried``: the protocol's name on the wire (its messages' action, the record its fields
  go under) and how the runtime carries it.

The runtime (flower/protocols.py) carries any ``Carried`` protocol: it never imports the
feature; the assembler (runs/run_setup.py) hands it the feature's answers and the adapter
(engine/features/) its server's half.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

Fields = Mapping[str, object]  # one message's fields (a Flower ConfigRecord is one)

# (requests' fields by node, stage) -> the valid replies' fields by node: what carries them
Ask = Callable[[Mapping[int, dict], str], Mapping[int, Fields]]


class NodeState(Protocol):
    """What a node keeps between the messages of a run, never sent (Flower: the SuperNode's
    ``Context.state``): fields, or tensors, under a name."""

    def fields(self, name: str) -> Fields | None:
        """The fields kept under ``name`` (None: none kept)."""
        ...

    def keep_fields(self, name: str, fields: Mapping[str, object]) -> None: ...

    def tensors(self, name: str) -> dict[str, torch.Tensor] | None:
        """The tensors kept under ``name`` (None: none kept)."""
        ...

    def keep_tensors(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None: ...

    def forget(self, name: str) -> None:
        """Drop what is kept under ``name`` (nothing kept: nothing to do)."""
        ...


# a node's reply to one request: (the request's fields, its state) -> the reply's fields
Answer = Callable[[Fields, NodeState], dict]


@dataclass(frozen=True)
class Carried:
    """A protocol as the runtime carries it: its messages' ``action`` (Flower: the message
    type ``query.<action>``), the ``record`` its fields go under in every message both ways,
    whether its stages may also ride with the round's other messages (``rides``: its
    request query and train messages), and whether a node's reply says how long the node
    worked (``timed``: a round's own waves, counted in its costs); ``title`` names it in
    errors and logs."""

    action: str
    record: str
    title: str
    rides: bool = False
    timed: bool = False


@dataclass(frozen=True)
class NodeFacts:
    """What a node knows of itself that a protocol's answer may read: its client (partition)
    id, its rows S(k) per table (sorted row ids), every table's size, and how many training
    samples it holds."""

    client: int
    rows: Mapping[str, np.ndarray]
    table_rows: Mapping[str, int]
    num_samples: int
