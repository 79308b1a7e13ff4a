"""Flower's capabilities (``algorithms/runtimes.py``): fedsub's ClientApp is stateless (a
node keeps nothing of the algorithm between rounds), each node is one client, and the apps
run on the CPU; private download and secure aggregation run over Flower Messages
(``flower/private_download.py``, ``flower/secure_rows.py``). Differential privacy (``[dp]``)
runs as in process: central at ``privacy.level`` none, heat or download (the engine's round
loop, which the ServerApp runs, clips, noises and accounts), distributed at ``full`` (each node
adds its discrete Gaussian share to the secure row sum, flower/secure_rows.py; the loop's
ledger accounts it)."""

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
        "devices": (
            "The Flower apps run on the CPU for now (their index sets are host arrays); "
            "on Flower use execution.device = 'cpu'"
        ),
    },
)
