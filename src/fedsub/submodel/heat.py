"""Row heat and FedSubAvg's correction coefficients.

For row ``m`` of a table, ``n_m`` is the number of clients whose data touch it and the
sample-weighted heat is ``sum of w_k over those clients``. FedSubAvg scales row m's round
aggregate by ``N / n_m`` (heat = "clients", Algorithm 1) or ``sum_k w_k / sum_{k: m in S(k)} w_k``
(heat = "samples", appendix D.4), so that in expectation the row moves by the average update of
the clients that involve it. Rows no client touches get coefficient 1 (they never move anyway).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from fedsub.data.ragged import Ragged

HeatKind = Literal["clients", "samples"]


def client_heat(rows: Ragged, num_rows: int, keep: range | None = None) -> np.ndarray:
    """``n_m``: how many clients touch each row (``rows`` = every client's S(k)); with
    ``keep``, of those rows only (position i is row ``keep[i]``)."""
    values, _ = _kept(rows.values, keep)
    return np.bincount(values, minlength=_length(num_rows, keep)).astype(np.int64)


def sample_heat(
    rows: Ragged, num_rows: int, sample_counts: np.ndarray, keep: range | None = None
) -> np.ndarray:
    """Sum of ``w_k`` over the clients touching each row (of ``keep`` only, when given)."""
    weights = np.repeat(sample_counts.astype(np.float64), rows.lengths())
    values, inside = _kept(rows.values, keep)
    if inside is not None:
        weights = weights[inside]
    return np.bincount(values, weights=weights, minlength=_length(num_rows, keep))


def heat(
    rows: Ragged,
    num_rows: int,
    sample_counts: np.ndarray,
    kind: HeatKind,
    keep: range | None = None,
) -> np.ndarray:
    """The heat of every row, or of the rows ``keep`` (a process's share of a row-sharded
    table: the heat of its rows, without an array as long as the table)."""
    if kind == "clients":
        return client_heat(rows, num_rows, keep).astype(np.float64)
    if kind == "samples":
        return sample_heat(rows, num_rows, sample_counts, keep)
    raise ValueError(f"heat kind must be 'clients' or 'samples', got {kind!r}")


def _kept(values: np.ndarray, keep: range | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The ids of ``keep`` among ``values``, shifted to start at 0, and where they were."""
    if keep is None:
        return values, None
    inside = (values >= keep.start) & (values < keep.stop)
    return values[inside] - keep.start, inside


def _length(num_rows: int, keep: range | None) -> int:
    return num_rows if keep is None else len(keep)


def coefficients(row_heat: np.ndarray, total: float) -> np.ndarray:
    """``total / heat[m]`` for touched rows, 1 for untouched ones."""
    coef = np.ones(len(row_heat), dtype=np.float64)
    touched = row_heat > 0
    coef[touched] = total / row_heat[touched]
    return coef


def dispersion(row_heat: np.ndarray) -> float:
    """Heat dispersion max/min over the rows some client touches (seed 001, section 2)."""
    touched = row_heat[row_heat > 0]
    return float(touched.max() / touched.min()) if len(touched) else float("nan")
