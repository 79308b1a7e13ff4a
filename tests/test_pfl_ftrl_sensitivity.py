"""benchmarks/pfl_ftrl_engine.py's ``separated_sensitivity``: the sensitivity of a matrix
mechanism's strategy C (Gram X = C^T C) for participations at least b rounds apart, checked
against an enumeration of every such participation set, written out here; and the reason
pfl 0.6's reported epsilon understates its run's (its strategy is cholesky(X): unit rows, not
unit columns)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from pfl_ftrl_engine import separated_sensitivity


def banded_gram(n: int, band: int, seed: int) -> np.ndarray:
    """A positive definite Gram matrix zero at |i - j| >= band, unit diagonal."""
    generator = np.random.default_rng(seed)
    c = np.tril(generator.normal(size=(n, n)))
    c[np.subtract.outer(np.arange(n), np.arange(n)) >= band] = 0.0  # banded lower triangular
    c += n * np.eye(n)
    x = c.T @ c
    scale = 1.0 / np.sqrt(np.diag(x))
    return x * np.outer(scale, scale) * generator.uniform(0.5, 2.0)


def enumerated(gram: np.ndarray, separation: int) -> float:
    """sqrt(max over every set P of rounds pairwise >= separation apart of sum_{p,q in P}
    gram[p, q])."""
    n, best = len(gram), 0.0
    for size in range(1, n + 1):
        for rounds in itertools.combinations(range(n), size):
            if all(b - a >= separation for a, b in itertools.pairwise(rounds)):
                best = max(best, float(gram[np.ix_(rounds, rounds)].sum()))
    return float(np.sqrt(best))


@pytest.mark.parametrize(("n", "separation", "seed"), [(7, 2, 0), (9, 3, 1), (10, 4, 2)])
def test_separated_sensitivity_is_the_enumerated_maximum(n: int, separation: int, seed: int):
    gram = banded_gram(n, separation, seed)
    gram[np.diag_indices(n)] *= np.random.default_rng(seed).uniform(0.5, 3.0, n)
    assert separated_sensitivity(gram, separation) == pytest.approx(enumerated(gram, separation))


def test_a_gram_wider_than_the_separation_is_refused():
    with pytest.raises(ValueError, match="not banded"):
        separated_sensitivity(np.ones((5, 5)), 2)


def test_cholesky_of_a_unit_diagonal_gram_has_unit_rows_not_unit_columns():
    """pfl 0.6 keeps diag(X) = 1 and takes C = cholesky(X) (L L^T = X): the sensitivity its
    accountant assumes, sqrt(k), is that of columns of norm 1, which L does not have."""
    n, separation = 12, 4
    x = banded_gram(n, separation, 3)
    x /= np.diag(x).max()
    x[np.diag_indices(n)] = 1.0
    low = np.linalg.cholesky(x)
    np.testing.assert_allclose((low**2).sum(axis=1), 1.0)
    k = (n - 1) // separation + 1
    assert separated_sensitivity(low.T @ low, separation) > np.sqrt(k) * 1.01
