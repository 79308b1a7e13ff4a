"""Li et al.'s sampling and averaging schemes (seed 004), as (sampler, weighting, lr scale).

With ``p_k = n_k / n`` over all N clients and a round's deltas ``delta_k``:

- ``default``: K distinct clients uniformly; ``sum_k w_k delta_k / sum_k w_k`` over the round
  (FedAvg as implemented by the FedSubAvg authors).
- ``scheme1``: K draws with replacement, ``P(k) = p_k``; plain average over the K draws.
- ``scheme2`` (the paper's, Assumption 6): K distinct clients uniformly; the models are
  averaged, ``w_{t+1} = (N / K) sum_k p_k w_k``, i.e. the old model rescaled by
  ``f = (N / K) sum_k p_k`` plus ``(N / K) sum_k p_k delta_k``. f != 1 on unbalanced data:
  the instability of the paper's Figures 1d and 4.
- ``scheme2-delta`` (fedsub's variant, not the paper's): the same weights on the deltas only,
  ``w_{t+1} = w_t + (N / K) sum_k p_k delta_k`` (the old model keeps weight 1).
- ``transformed-scheme2``: K distinct clients uniformly; local lr scaled by ``p_k N``; plain
  average.
- ``original`` (McMahan et al.): K distinct clients uniformly; ``sum_k p_k delta_k``, i.e. the
  old model keeps weight ``1 - sum_k p_k``.

Schemes I and II (both forms) are unbiased estimates of the full-participation model
``sum_k p_k w_k`` (E[f] = 1); the original scheme is not (it shrinks the update by about K / N).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsub.algorithms.aggregation import Weighting
from fedsub.algorithms.sampling import SamplingKind


@dataclass(frozen=True)
class Scheme:
    sampling: SamplingKind
    weighting: Weighting | None  # None: the algorithm's own weighting
    scale_lr_by_pn: bool = False
    model_average: bool = False  # the old model is rescaled by the weights' sum (Scheme II)


SCHEMES: dict[str, Scheme] = {
    "default": Scheme("uniform", None),
    "scheme1": Scheme("proportional-with-replacement", "uniform"),
    "scheme2": Scheme("uniform", "scheme2", model_average=True),
    "scheme2-delta": Scheme("uniform", "scheme2"),
    "transformed-scheme2": Scheme("uniform", "uniform", scale_lr_by_pn=True),
    "original": Scheme("uniform", "original"),
}
