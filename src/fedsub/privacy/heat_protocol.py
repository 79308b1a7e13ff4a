"""The private heat exchange as a protocol a runtime carries: fedsub's secure aggregation (and
randomized response) between the server and the nodes, so the server never receives a node's
S(k). Written against fedsub/feature_messages.py's types alone; Flower carries it as
``query.heat`` Messages (flower/protocols.py), every other runtime may too.

The stages are ``privacy/secure_sum.py``'s, the messages checked in
``privacy/secagg_records.py``; a node's protocol state (its private keys, the shares it
received) stays in its ``NodeState``. docs/tutorials/flower.md, "Private heat on Flower".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from fedsub.errors import FedsubError
from fedsub.feature_messages import Answer, Ask, Carried, Fields, NodeState
from fedsub.privacy import secure_sum
from fedsub.privacy.heat_report import PrivateHeatStage
from fedsub.privacy.heat_sources import HeatPrivacy
from fedsub.privacy.heat_vectors import MeasuredHeat
from fedsub.privacy.secagg_records import text_field
from fedsub.submodel.heat import HeatKind

# the heat exchange's messages: Flower's "query.heat", their fields a "heat" record both ways
HEAT = Carried("heat", "heat", "heat exchange")
STATE = "fedsub.heat-exchange"  # the node's protocol state in its NodeState


# ---- the node's side ---------------------------------------------------------------------


def answer_stage(
    request: Fields,
    state: NodeState,
    reply_of: Callable[[Fields, Fields | None], tuple[dict, Fields | None]],
    who: str,
) -> dict:
    """The reply to ``reply_of(request, protocol state)``; the node's protocol state kept
    (or, once done, forgotten; a randomized-response "report" keeps none)."""
    reply, after = reply_of(request, state.fields(STATE))
    if text_field(request, "stage", who) != "report":
        if after is None:
            state.forget(STATE)  # done: forget the keys
        else:
            state.keep_fields(STATE, after)
    return reply


def heat_answer(
    privacy: HeatPrivacy,
    kind: HeatKind,
    table_rows: Mapping[str, int],
    rows: Mapping[str, np.ndarray],
    num_samples: int,
) -> Answer:
    """A node's answer to each stage of the heat exchange: its rows S(k) (``rows``) and
    sample count by its ``privacy.heat_source``."""
    who = "heat exchange (this node)"
    facts = (privacy, kind, table_rows, rows, num_samples, who)
    return lambda request, state: answer_stage(
        request, state, lambda r, s: secure_sum.heat_reply(r, s, *facts), who
    )


def secagg_answer(source: str, vector: Callable[[Fields], np.ndarray], who: str) -> Answer:
    """A node's answer to each stage of a secure sum (the heat exchange's, or the secure row
    sums' of privacy/secure_rows_protocol.py): ``source`` is what this node agrees to sum,
    ``vector`` gives its uint32 input from the "mask" request."""
    return lambda request, state: answer_stage(
        request,
        state,
        lambda r, s: secure_sum.secure_sum_reply(r, s, source, vector, who),
        who,
    )


# ---- the server's side -------------------------------------------------------------------


class HeatExchange(PrivateHeatStage):
    """Where a run's heat comes from when the server talks to the nodes
    (``privacy.heat_source``): the registered S(k) (exact), or the private exchange with the
    counted nodes (``private``), measured once and kept as a checkpoint stage (the runtime's
    ``private_heat``: a resumed run's comes from its checkpoint)."""

    carried = HEAT

    def __init__(self, privacy: HeatPrivacy | None = None) -> None:
        self.privacy = privacy or HeatPrivacy()
        super().__init__(self.privacy.source)

    @property
    def private(self) -> bool:
        """Whether a private source measures the heat (no S(k) registered)."""
        return self.privacy.source != "exact"

    def measured(
        self, ask: Ask, nodes: Mapping[int, int], tables: Mapping[str, int], kind: HeatKind
    ) -> MeasuredHeat:
        """The heat of the exchange (its stages through ``ask``) with every counted client
        (``nodes``: client -> its node), each of which must contribute (once: then, or after
        a resume, the report kept)."""
        if self.report is None:
            report = secure_sum.measure_heat(ask, list(nodes.values()), self.privacy, kind, tables)
            missing = sorted(k for k, n in nodes.items() if n not in report.contributors)
            if missing:
                raise FedsubError(
                    f"Flower: heat exchange ({self.privacy.source}): no contribution from "
                    f"partition(s) {missing[:10]}; every registered partition must be in the "
                    "heat"
                )
            self.report = report
        return self.report.measured
