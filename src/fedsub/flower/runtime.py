"""Flower's capabilities (``algorithms/runtimes.py``), against which the registry checks a run:
fedsub's ClientApp keeps nothing of the algorithm between rounds, each node is one client, the
apps run on the CPU; private rounds and ``[dp]`` run over Flower Messages as in process.
"""

from __future__ import annotations

from fedsub.algorithms.runtimes import Runtime

FLOWER = Runtime(
    "Flower",
    frozenset({"private-rounds", "differential-privacy"}),
    hints={
        "client-state": "fedsub's ClientApp keeps nothing between rounds",
        "pooled-data": "each Flower node is one client",
        "masking": (
            "Sub-model masking runs in-process only (fedsub compare); on Flower use "
            "masking.scheme = 'none'"
        ),
        "virtual-clock": (
            "The virtual clock's synchronous rounds ([clock]) simulate time in-process only "
            "(fedsub compare); on Flower time and availability are the nodes' own: use "
            "clock.mode = 'off', or 'fedbuff' (FedBuff over the real nodes, in real time)"
        ),
        "devices": (
            "The Flower apps run on the CPU for now (their index sets are host arrays); "
            "on Flower use execution.device = 'cpu'"
        ),
    },
)
