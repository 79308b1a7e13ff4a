"""An aggregation rule: FedSubAvg with each heat coefficient raised to a power.

``heat_power = 1`` is FedSubAvg, ``0`` FedAvg; values between shrink the correction of rarely
touched rows. Its combine step is the weighted sum (so secure sums and masking compute it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from fedsub.algorithms.aggregation import Aggregation
from fedsub.algorithms.aggregation_rules import AggregationInputs
from fedsub.algorithms.schemes import Scheme
from fedsub.algorithms.weighting import Weighting


@dataclass(frozen=True)
class HeatPower:
    name: ClassVar[str] = "heat-power"
    description: ClassVar[str] = (
        "FedSubAvg's mean, each row times its heat coefficient ** heat_power"
    )
    pools_data: ClassVar[bool] = False
    needs_heat: ClassVar[bool] = True
    secure_sum_ok: ClassVar[bool] = True
    weights_sum_to_one: ClassVar[bool] = True
    heat_power: float = field(default=0.5, metadata={"min": 0.0, "max": 1.0})

    def build(self, inputs: AggregationInputs, scheme: Scheme) -> Aggregation:
        coefficients = {t: c**self.heat_power for t, c in inputs.heat_coefficients().items()}
        weighting: Weighting = "samples" if inputs.heat == "samples" else "uniform"
        return inputs.aggregation(scheme, weighting, coefficients=coefficients)
