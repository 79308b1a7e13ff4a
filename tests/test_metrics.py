"""Exact ROC AUC against scikit-learn, with and without ties."""

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from fedsub.engine.metrics import average_ranks, roc_auc


@pytest.mark.parametrize("seed", range(5))
def test_auc_matches_sklearn_with_ties(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(2, size=500)
    scores = rng.integers(0, 12, size=500) / 4.0  # heavy ties
    assert roc_auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    continuous = rng.normal(size=500) + labels
    assert roc_auc(labels, continuous) == pytest.approx(
        roc_auc_score(labels, continuous), abs=1e-12
    )


def test_auc_extremes_and_single_class():
    labels = np.array([0, 0, 1, 1])
    assert roc_auc(labels, np.array([0.1, 0.2, 0.3, 0.4])) == 1.0
    assert roc_auc(labels, np.array([0.4, 0.3, 0.2, 0.1])) == 0.0
    assert roc_auc(labels, np.zeros(4)) == 0.5
    assert np.isnan(roc_auc(np.ones(4), np.arange(4.0)))


def test_average_ranks_share_ties():
    np.testing.assert_array_equal(average_ranks(np.array([3.0, 1.0, 3.0, 2.0])), [3.5, 1, 3.5, 2])
