"""Seed 004's MNIST splits (Li et al., appendix D, Table 2) on label arrays of MNIST's sizes.

Table 2: balanced 100 devices x 542 samples (54,200), 2 digits each; unbalanced 62,864
training samples, 628 per device on average, std 800, sizes following a power law.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedsub.data import partition
from fedsub.data.images import ImageOptions, load
from fedsub.errors import DataError

from .test_images import write_image_set

# samples per digit in MNIST's training file and in training + test files (70,000)
MNIST_TRAIN = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_ALL = [6903, 7877, 6990, 7141, 6824, 6313, 6876, 7293, 6825, 6958]


def labels_of(counts: list[int]) -> np.ndarray:
    return np.random.default_rng(99).permutation(np.repeat(np.arange(10), counts))


def unbalanced(seed: int, sigma: float = 2.0):
    labels = labels_of(MNIST_ALL)
    rng = np.random.default_rng(seed)
    parts = partition.li_unbalanced(labels, 100, 2, sigma, rng)
    train, test = partition.split_each(parts, 0.1, rng)
    return labels, parts, train, test


def test_li_unbalanced_has_table_2_size_statistics():
    stds = []
    for seed in range(20):
        labels, parts, train, test = unbalanced(seed)
        sizes = np.array([len(t) for t in train])
        # Table 2: 62,864 samples, mean 628 (over seeds: 62,865 +- 5)
        assert abs(sizes.sum() - 62_864) <= 20 and abs(sizes.mean() - 628) < 1
        stds.append(sizes.std())
        everything = np.concatenate(parts)
        assert len(everything) == len(np.unique(everything)) > 69_800  # disjoint, floors lose ~100
        for u, (part, held) in enumerate(zip(train, test, strict=True)):
            assert sorted(np.unique(labels[np.concatenate([part, held])])) == sorted(
                {u % 10, (u + 1) % 10}
            )
            assert len(part) == int(0.9 * (len(part) + len(held)))
    # Table 2's std 800 is one draw; this construction's spread over seeds holds it
    assert min(stds) < 800 < max(stds)
    assert 850 < np.mean(stds) < 1050


@pytest.mark.parametrize("sigma", [1.0, 2.0])
def test_li_unbalanced_shares_are_lognormal(sigma):
    """Each digit's slots (beyond the 5 every slot gets) are LogNormal(0, sigma) shares: the
    spread of log sizes within a digit is sigma (a little less at 2: shares under one sample
    floor to zero and drop out), and a tenth of the devices hold about half the data."""
    logs, top_shares = [], []
    for seed in range(10):
        labels, parts, train, _ = unbalanced(seed, sigma)
        held = np.array([[np.sum(labels[p] == d) for d in range(10)] for p in parts])
        for digit in range(10):
            extra = held[:, digit][held[:, digit] > 5] - 5
            logs.append(np.log(extra) - np.log(extra).mean())
        sizes = np.sort([len(t) for t in train])
        top_shares.append(sizes[-10:].sum() / sizes.sum())
    spread = np.concatenate(logs).std()
    assert sigma - 0.2 < spread < sigma + 0.05
    assert np.mean(top_shares) > (0.45 if sigma == 2.0 else 0.2)


def test_li_balanced_is_the_authors_equal_split():
    labels = labels_of(MNIST_TRAIN)
    parts = partition.li_balanced(labels, 100, 2, 271, np.random.default_rng(3))
    assert [len(p) for p in parts] == [542] * 100
    everything = np.concatenate(parts)
    assert len(np.unique(everything)) == 54_200
    pairs = []
    for p in parts:
        digits, counts = np.unique(labels[p], return_counts=True)
        assert len(digits) == 2 and counts.tolist() == [271, 271]
        pairs.append(tuple(digits))
    holders = np.bincount(np.concatenate(pairs), minlength=10)
    assert holders.tolist() == [20] * 10  # 20 shards of 271 per digit
    assert len(set(pairs)) > 15  # digits paired at random, not in a few fixed pairs
    again = partition.li_balanced(labels, 100, 2, 271, np.random.default_rng(3))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_li_balanced_refuses_what_it_cannot_deal():
    labels = labels_of(MNIST_TRAIN)
    with pytest.raises(DataError, match=r"label 5 has 5421 samples, but 20 clients need 272"):
        partition.li_balanced(labels, 100, 2, 272, np.random.default_rng(0))
    with pytest.raises(DataError, match="k = 11 but there are only 10 labels"):
        partition.li_balanced(labels, 10, 11, 5, np.random.default_rng(0))


def test_loader_li_unbalanced_pools_both_files_and_splits_each_device(tmp_path):
    folder = write_image_set(tmp_path / "idx", n_train=400, n_test=100)
    dataset = load("mnist", ImageOptions(partition="li-unbalanced", num_clients=10), str(folder), 0)
    sizes = dataset.sample_counts()
    # 10 devices x 2 digits x 5 samples first; the rest of the 500 by power-law shares
    assert dataset.num_clients == 10 and sizes.min() >= 9 and sizes.std() > 0
    assert 400 < sizes.sum() + len(dataset.test) <= 500
    assert len(dataset.test) >= 10  # each device keeps at least one sample for the test set
    for u in range(10):
        assert set(np.unique(dataset.client(u).labels).astype(int)) == {u, (u + 1) % 10}
    assert set(np.unique(dataset.test.labels).astype(int)) == set(range(10))


def test_loader_li_balanced_needs_equal_shards(tmp_path):
    folder = write_image_set(tmp_path / "idx")
    options = ImageOptions(num_clients=10, samples_per_client=21)
    with pytest.raises(DataError, match="samples_per_client = 21 must be a multiple of"):
        load("mnist", options, str(folder), 0)
