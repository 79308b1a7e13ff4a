"""The benchmark workloads, generated: clients of equal size, Zipf item popularity."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged


def zipf_clicks(
    clients: int = 1000,
    samples_per_client: int = 100,
    rows: int = 20_000,
    ids_per_sample: int = 5,
    exponent: float = 1.1,
    seed: int = 0,
) -> FederatedDataset:
    """Issue 5's workload: each sample has ``ids_per_sample`` ids drawn Zipf(exponent) over
    ``rows``; labels from a hidden logistic model over the ids."""
    rng = np.random.default_rng(seed)
    n = clients * samples_per_client
    popularity = 1.0 / np.arange(1, rows + 1) ** exponent
    cumulative = np.cumsum(popularity / popularity.sum())
    ids = np.searchsorted(cumulative, rng.random((n, ids_per_sample)))
    ids = np.minimum(ids, rows - 1)
    weights = rng.normal(size=rows)
    labels = (rng.random(n) < 1 / (1 + np.exp(-weights[ids].sum(1)))).astype(np.float32)
    train = SampleSet({"features": Ragged.from_fixed(ids)}, labels)
    offsets = np.arange(0, n + 1, samples_per_client, dtype=np.int64)
    test = train.slice(0, min(n, 1000))
    return FederatedDataset("zipf-clicks", {"features": rows}, train, offsets, test)


def amazon_like(
    users: int = 1859,
    samples_per_user: int = 54,
    items: int = 60_000,
    max_history: int = 20,
    exponent: float = 1.1,
    seed: int = 0,
) -> FederatedDataset:
    """The FedSubAvg authors' Amazon shape: 1,859 users with ~54 training samples each,
    Zipf item popularity, ragged click histories; fields user / item / history."""
    rng = np.random.default_rng(seed)
    n = users * samples_per_user
    popularity = 1.0 / np.arange(1, items + 1) ** exponent
    cumulative = np.cumsum(popularity / popularity.sum())

    def draw(size: int) -> np.ndarray:
        return np.minimum(np.searchsorted(cumulative, rng.random(size)), items - 1)

    lengths = rng.integers(0, max_history + 1, size=n)
    history = Ragged(draw(int(lengths.sum())), np.r_[0, np.cumsum(lengths)].astype(np.int64))
    samples = SampleSet(
        {
            "user": Ragged.from_fixed(np.repeat(np.arange(users), samples_per_user)[:, None]),
            "item": Ragged.from_fixed(draw(n)[:, None]),
            "history": history,
        },
        (rng.random(n) < 0.555).astype(np.float32),
    )
    offsets = np.arange(0, n + 1, samples_per_user, dtype=np.int64)
    return FederatedDataset(
        "amazon-like",
        {"user": users, "item": items},
        samples,
        offsets,
        samples.slice(0, 2000),
        {"user": "user", "item": "item", "history": "item"},
    )


def power_law_ids(rng: np.random.Generator, size, rows: int, exponent: float) -> np.ndarray:
    """Ids in [0, rows) with P(rank r) ~ r^-exponent (a continuous Zipf by inverse CDF): no
    table-sized array, so it serves 1e9-row tables too."""
    u = rng.random(size)
    if exponent == 1.0:
        ranks = np.exp(u * np.log(rows + 1.0))
    else:
        top = (rows + 1.0) ** (1.0 - exponent)
        ranks = (1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - exponent))
    return np.minimum(ranks.astype(np.int64) - 1, rows - 1)


def lognormal_zipf(
    clients: int = 100_000,
    mean_samples: float = 49.0,
    sigma: float = 1.0,
    rows: int = 10**7,
    ids_per_sample: int = 10,
    exponent: float = 1.1,
    seed: int = 0,
) -> FederatedDataset:
    """Issue 15's probe workload: client sizes lognormal (mean ``mean_samples``, at least 1;
    100,000 clients hold ~4.9M samples), each sample ``ids_per_sample`` Zipf(``exponent``)
    ids over ``rows``; labels from a hidden logistic model over the ids (one weight per row,
    drawn from the ids' hash so no table-sized array is needed)."""
    rng = np.random.default_rng(seed)
    mu = np.log(mean_samples) - sigma**2 / 2
    counts = np.maximum(1, rng.lognormal(mu, sigma, size=clients).astype(np.int64))
    n = int(counts.sum())
    ids = power_law_ids(rng, (n, ids_per_sample), rows, exponent)
    hidden = np.sin(ids * 12.9898).sum(1)  # a fixed pseudo-random weight per row
    labels = (rng.random(n) < 1 / (1 + np.exp(-hidden))).astype(np.float32)
    train = SampleSet({"features": Ragged.from_fixed(ids)}, labels)
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    test = train.slice(0, min(n, 1000))
    return FederatedDataset("lognormal-zipf", {"features": rows}, train, offsets, test)


# The FedSubAvg authors' Amazon per-user files (reference-notes.md; statistics measured on them)
AMAZON_USERS, AMAZON_LINES, AMAZON_ITEMS = 1859, 99_710, 63_001


def write_amazon_files(
    folder: Path,
    users: int = AMAZON_USERS,
    lines: int = AMAZON_LINES,
    items: int = AMAZON_ITEMS,
    seed: int = 1,
) -> Path:
    """Per-user files in the authors' format (``user_<uid>``: label, user, target item,
    comma-separated history; ``0`` = no history) with their statistics: 1,859 users and 99,710
    lines (at least 20 a user, the rest lognormal(0, 0.85)); each line's history is the user's
    earlier clicked targets (at most 229), so lengths have mean ~20, median 15, p99 ~110, max
    ~229 (the files: 20, 14, 117, 229); targets Zipf(0.545) over 63,001 items, so an item's
    heat (users touching it) has max ~240 and median 2 (the files: 232, 2); positive rate
    0.555."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(0.0, 0.85, size=users)
    sizes = 20 + np.floor(raw / raw.sum() * (lines - 20 * users)).astype(np.int64)
    sizes[: lines - int(sizes.sum())] += 1
    popularity = 1.0 / np.arange(1, items + 1) ** 0.53
    cumulative = np.cumsum(popularity / popularity.sum())
    folder.mkdir(parents=True, exist_ok=True)
    for user, size in enumerate(sizes):
        targets = np.minimum(np.searchsorted(cumulative, rng.random(size)), items - 1) + 1
        labels = rng.random(size) < 0.555
        clicked: list[str] = []
        text = []
        for target, label in zip(targets, labels, strict=True):
            history = ",".join(clicked[-229:]) or "0"
            text.append(f"{int(label)}\t{user + 1}\t{target}\t{history}\n")
            if label:
                clicked.append(str(target))
        (folder / f"user_{user + 1}").write_text("".join(text))
    return folder


def amazon_files(folder: Path | None = None, seed: int = 1) -> FederatedDataset:
    """``write_amazon_files`` read back by fedsub's loader (``amazon-fedsubavg``: the last 20%
    of each user's lines are the test set), as a run on the authors' files would read them."""
    from fedsub.data.amazon import AmazonFilesOptions, load_fedsubavg_files

    folder = folder or Path(tempfile.gettempdir()) / f"fedsub-amazon-shape-{seed}"
    if not (folder / "complete").exists():
        write_amazon_files(folder, seed=seed)
        (folder / "complete").write_text("")
    return load_fedsubavg_files(AmazonFilesOptions(), str(folder), 0)


def sent140_like(
    users: int = 1_473,
    mean_tweets: float = 79_050 / 1_473,
    min_tweets: int = 41,
    vocab_size: int = 10_000,
    words_seen: int = 50_000,
    mean_words: float = 14.98,
    max_tokens: int = 25,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> FederatedDataset:
    """Seed 001's Sent140 shape (Table 1): 1,473 users with more than 40 tweets, 79,050 tweets
    (~54 per user), 80/20 split per user, as ``configs/sent140-lstm.toml`` loads it.

    Tweets per user: a Pareto tail above ``min_tweets`` whose mean is ``mean_tweets``. Words:
    Zipf(1) ranks over ``words_seen`` distinct words, ranks past ``vocab_size`` read as the
    out-of-vocabulary id 0 (about 15% of tokens), as fedsub's loader keeps the most frequent
    words. Tweet lengths in words: gamma (shape 3) with mean ``mean_words`` (the average of
    1.5M tweets of early 2009, when Sentiment140 was collected: Oxford English Corpus),
    at least 1, cut at ``max_tokens`` (the loader's cut: ~13% of tweets reach it). Labels from
    a hidden per-word polarity."""
    rng = np.random.default_rng(seed)
    alpha = mean_tweets / (mean_tweets - min_tweets)  # a Pareto's mean is alpha x_m / (alpha - 1)
    tweets = np.floor(min_tweets * (1.0 - rng.random(users)) ** (-1.0 / alpha)).astype(np.int64)
    lengths = np.clip(np.rint(rng.gamma(3.0, mean_words / 3.0, size=int(tweets.sum()))), 1, None)
    lengths = np.minimum(lengths, max_tokens).astype(np.int64)
    ranks = power_law_ids(rng, int(lengths.sum()), words_seen, 1.0)  # 0-based ranks
    words = np.where(ranks < vocab_size, ranks + 1, 0)
    polarity = rng.normal(size=vocab_size + 1)
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    score = np.add.reduceat(polarity[words], offsets[:-1]) / np.sqrt(lengths)
    score -= np.median(score)  # half positive, as Sentiment140's 800,000 / 800,000
    labels = (rng.random(len(lengths)) < 1 / (1 + np.exp(-2 * score))).astype(np.float32)
    tweet_owner = np.repeat(np.arange(users), tweets)
    is_test = rng.random(len(lengths)) < test_fraction
    is_test[np.r_[0, np.cumsum(tweets)[:-1]]] = False  # every user keeps a training tweet
    everything = SampleSet({"words": Ragged(words, offsets)}, labels)
    train_rows = np.flatnonzero(~is_test)
    train_counts = np.bincount(tweet_owner[train_rows], minlength=users)
    return FederatedDataset(
        "sent140-like",
        {"words": vocab_size + 1},
        everything.take(train_rows),
        np.r_[0, np.cumsum(train_counts)].astype(np.int64),
        everything.take(np.flatnonzero(is_test)),
    )
