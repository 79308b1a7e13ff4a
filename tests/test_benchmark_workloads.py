"""benchmarks/workloads.py's Sent140 shape has the statistics its docstring and
benchmarks/README.md state (seed 001's Table 1 and the loader's cuts)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from workloads import sent140_like


def test_sent140_like_has_the_papers_users_tweets_and_the_loaders_cuts():
    dataset = sent140_like()
    assert dataset.num_clients == 1_473
    tweets = len(dataset.train) + len(dataset.test)
    assert abs(tweets - 79_050) / 79_050 < 0.02  # the paper's count, ~54 per user
    assert abs(len(dataset.test) / tweets - 0.2) < 0.01  # the 80/20 split
    lengths = dataset.train.ids["words"].lengths()
    assert lengths.min() >= 1 and lengths.max() == 25  # max_tokens
    assert 13.5 < lengths.mean() < 15.0
    words = dataset.train.ids["words"].values
    assert dataset.table_rows["words"] == 10_001 and words.max() < 10_001
    assert 0.1 < (words == 0).mean() < 0.2  # out of vocabulary
    assert abs(dataset.train.labels.mean() - 0.5) < 0.02
    assert np.array_equal(sent140_like().train.ids["words"].values, words)  # seeded
