"""What a runtime (the in-process engine, Flower, ...) supports, declared by the runtime.

The algorithm layer never asks which runtime it runs on; it asks whether the runtime has a
capability (``Runtime.require``), and a refusal names the runtime and the missing
capability. A runtime declares its ``Runtime`` beside its code: ``engine/runtime.py``
(in-process) and ``flower/runtime.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from fedsub.errors import ConfigError

Capability = Literal[
    "client-state",  # clients keep state across rounds (SCAFFOLD's c_i)
    "pooled-data",  # one client holding every sample (central SGD)
    "masking",  # sub-model masking: width slices per client (masking.scheme)
    "devices",  # training on a device other than the CPU (execution.device)
    "private-rounds",  # private download and secure aggregation (privacy.level)
    "differential-privacy",  # user-level DP: clipping, noise, accountant ([dp], fedsub.dp)
    "virtual-clock",  # simulated time, availability, FedBuff ([clock], fedsub.clock)
]

CAPABILITIES: dict[Capability, str] = {
    "client-state": "clients that keep state across rounds",
    "pooled-data": "one client pooling every sample",
    "masking": "sub-model masking (width slices per client)",
    "devices": "devices other than the CPU",
    "private-rounds": "private download and secure aggregation",
    "differential-privacy": "user-level differential privacy ([dp] mechanism = gaussian)",
    "virtual-clock": "the virtual clock ([clock]: simulated device time, availability, FedBuff)",
}


@dataclass(frozen=True)
class Runtime:
    """A runtime's name, the capabilities it supports and, per missing capability, a hint
    that says what to do instead."""

    name: str
    supports: frozenset[Capability]
    hints: Mapping[Capability, str] = field(default_factory=dict)

    def has(self, capability: Capability) -> bool:
        return capability in self.supports

    def require(self, capability: Capability, what: str, because: str = "") -> None:
        """Refuse ``what`` (ConfigError) unless this runtime supports ``capability``."""
        if self.has(capability):
            return
        hint = self.hints.get(capability, "")
        raise ConfigError(
            f"{what} cannot run on {self.name}: {because + '; ' if because else ''}it needs "
            f"{CAPABILITIES[capability]} (capability {capability!r}), which {self.name} does "
            f"not support{'. ' + hint if hint else ''}"
        )
