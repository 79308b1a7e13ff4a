"""AUC from per-node score histograms: a global AUC with no sample leaving its node.

Each node counts its held-out positives and negatives per bin of the predicted probability
(``BINS`` equal bins of [0, 1]); the server adds the histograms and computes the AUC as if
samples in one bin were tied. Pairs in different bins are ordered exactly (a bin's scores are
all below the next bin's), and a pair in one bin counts 1/2 where the exact AUC counts 0, 1/2
or 1, so

    |exact AUC - binned AUC|  <=  bin_error = (1/2) * sum_b pos_b * neg_b / (P * N),

a bound computed from the histograms themselves (reported with the AUC).
"""

from __future__ import annotations

import numpy as np

BINS = 1000


def score_histograms(
    labels: np.ndarray, probabilities: np.ndarray, bins: int = BINS
) -> tuple[np.ndarray, np.ndarray]:
    """(positives per bin, negatives per bin) of probabilities in [0, 1]."""
    index = np.clip(np.floor(np.asarray(probabilities, np.float64) * bins), 0, bins - 1)
    positive = np.asarray(labels) > 0.5
    counts = [
        np.bincount(index[mask].astype(np.int64), minlength=bins) for mask in (positive, ~positive)
    ]
    return counts[0], counts[1]


def binned_auc(positives: np.ndarray, negatives: np.ndarray) -> tuple[float, float]:
    """(AUC with each bin's samples tied, the bound on its distance to the exact AUC);
    (nan, nan) when a class is missing."""
    pos = np.asarray(positives, np.float64)
    neg = np.asarray(negatives, np.float64)
    pairs = pos.sum() * neg.sum()
    if pairs == 0:
        return float("nan"), float("nan")
    below = np.cumsum(neg) - neg  # negatives in lower bins
    auc = float(np.sum(pos * (below + 0.5 * neg)) / pairs)
    return auc, float(0.5 * np.sum(pos * neg) / pairs)
