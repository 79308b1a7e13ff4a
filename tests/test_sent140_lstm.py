"""Sentiment140 in its two formats, the tokenizer and vocabulary, and the LSTM classifier."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from fedsub.data.sent140 import Sent140Options, load, tokenize
from fedsub.errors import DataError
from fedsub.models.base import Batch, forward
from fedsub.models.lstm import LSTMClassifier
from fedsub.models.packed_lstm import PackedPlan
from fedsub.submodel.index import SubmodelIndex

from .conftest import assert_backends_agree, assert_one_step_lowers_loss

WORDS = ["good", "bad", "happy", "sad", "love", "hate", "café", "day"]


def tweets(users: int = 5, per_user: int = 60, seed: int = 0):
    rng = np.random.default_rng(seed)
    for u in range(users):
        count = per_user if u else 10  # user 0 has too few tweets
        for j in range(count):
            polarity = 2 if j % 10 == 0 else int(rng.choice([0, 4]))  # every 10th neutral
            words = rng.choice(WORDS, size=rng.integers(1, 6))
            yield polarity, f"id{u}{j}", f"user{u}", " ".join(words) + " @friend http://x.co"


def write_csv(path, rows):
    with open(path, "w", newline="", encoding="latin-1") as handle:
        writer = csv.writer(handle, quoting=csv.QUOTE_ALL)
        for polarity, tid, user, text in rows:
            writer.writerow([polarity, tid, "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", user, text])


def test_tokenizer():
    assert tokenize("I LOVE it!! @bob http://t.co/x don't") == [
        "i",
        "love",
        "it",
        "<user>",
        "<url>",
        "don't",
    ]


def test_official_csv_latin1_neutral_dropped_and_small_users_left_out(tmp_path):
    rows = list(tweets())
    path = tmp_path / "training.csv"
    write_csv(path, rows)
    dataset = load(Sent140Options(vocab_size=5, max_tokens=4), str(path), 0)
    assert dataset.num_clients == 4  # user0 has only 10 tweets
    kept = [r for r in rows if r[2] != "user0" and r[0] != 2]
    assert len(dataset.train) + len(dataset.test) == len(kept)
    assert dataset.table_rows["words"] == 6  # 5 words + the out-of-vocabulary id 0
    lengths = dataset.train.ids["words"].lengths()
    assert lengths.max() <= 4
    assert set(np.unique(dataset.train.labels)) == {0.0, 1.0}


def test_leaf_json(tmp_path):
    users = ["a", "b"]
    data = {
        u: {
            "x": [["1", "date", "q", u, f"{w} day"] for w in WORDS * 6],
            "y": [i % 2 for i in range(len(WORDS) * 6)],
        }
        for u in users
    }
    (tmp_path / "all_data_0.json").write_text(
        json.dumps({"users": users, "num_samples": [48, 48], "user_data": data})
    )
    dataset = load(Sent140Options(), str(tmp_path), 1)
    assert dataset.num_clients == 2 and len(dataset.train) + len(dataset.test) == 96


@pytest.mark.parametrize(
    "content, message",
    [
        ('"4","1","d","q","u"\n', "line 1: expected 6 fields"),
        ('"3","1","d","q","u","t"\n', "line 1: polarity must be 0, 2 or 4, got '3'"),
    ],
)
def test_bad_csv_lines(tmp_path, content, message):
    path = tmp_path / "t.csv"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        load(Sent140Options(), str(path), 0)


def test_bad_leaf_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"users": ["a"], "user_data": {"a": {"x": ["hi"], "y": [0, 1]}}}')
    with pytest.raises(DataError, match="user 'a' needs lists x and y of equal length"):
        load(Sent140Options(), str(path), 0)


@pytest.fixture(scope="module")
def sent(tmp_path_factory):
    path = tmp_path_factory.mktemp("s") / "t.csv"
    write_csv(path, list(tweets(users=6)))
    dataset = load(Sent140Options(vocab_size=20, max_tokens=6), str(path), 0)
    return dataset, SubmodelIndex.build(dataset)


def test_lstm_shapes_and_a_step_lowers_the_loss(sent):
    dataset, _ = sent
    model = LSTMClassifier(dict(dataset.table_rows), embedding_dim=5, hidden=7)
    params = model.init(torch.Generator().manual_seed(0), torch.float64)
    batch = Batch.from_samples(dataset.train.take(np.arange(20)), torch.float64)
    assert forward(model, params, batch).shape == (20,)
    assert_one_step_lowers_loss(model, params, batch, lr=0.5)


def test_lstm_padding_changes_nothing_and_backends_agree(sent):
    dataset, index = sent
    model = LSTMClassifier(dict(dataset.table_rows), embedding_dim=4, hidden=5)
    params = model.init(torch.Generator().manual_seed(1), torch.float64)
    one = Batch.from_samples(dataset.train.take(np.array([3])), torch.float64)
    many = Batch.from_samples(dataset.train.take(np.arange(10)), torch.float64)
    torch.testing.assert_close(forward(model, params, one)[0], forward(model, params, many)[3])
    assert_backends_agree(model, dataset, index, "fedsubavg", 3, lr=0.3)


def test_packed_plan_runs_each_step_on_the_rows_still_going():
    plan = PackedPlan.of(np.array([[2, 5, 0], [1, 1, 3], [0, 0, 0]]))
    assert plan.order.tolist() == [[1, 0, 2], [2, 0, 1], [0, 1, 2]]  # longest first, stable
    assert plan.lengths.tolist() == [[5, 2, 0], [3, 1, 1], [0, 0, 0]]
    # step t runs, for the first `clients` clients, their first `rows` sorted rows
    assert plan.rows == (3, 2, 1, 1, 1)
    assert plan.clients == (2, 2, 2, 1, 1)
    empty = PackedPlan.of(np.zeros((2, 3), dtype=np.int64))
    assert empty.steps == 0 and empty.rows == () and empty.clients == ()


def cohort_features(model, params, lengths, generator):
    """K x B sequences of the given lengths (random word ids), embedded as the engine does."""
    k, b = lengths.shape
    rows = params.tables["words"].shape[0]
    ids = torch.randint(0, rows, (int(lengths.sum()),), generator=generator)
    offsets = torch.from_numpy(np.r_[0, np.cumsum(lengths.reshape(-1))])
    features = model.embed(params.tables, {"words": (ids, offsets)})
    return {name: f.reshape(k, b, *f.shape[1:]) for name, f in features.items()}


@pytest.mark.parametrize(
    "lengths",
    [
        [[3, 0, 6, 1], [2, 2, 2, 2], [0, 0, 0, 0]],  # an empty tweet, a client with none
        [[1, 1, 1, 1], [5, 4, 5, 1], [6, 1, 1, 1]],  # clients finishing at different steps
        [[4, 4, 4, 4], [4, 4, 4, 4], [4, 4, 4, 4]],  # nothing to pack
    ],
)
def test_packed_cohort_head_equals_the_padded_form_values_and_gradients(lengths):
    """float64, a different dense model per client: the packed head (hand-written backward)
    against the padded form under autograd (the reference ``head`` runs), outputs and the
    gradients of every dense parameter and of the embedding table."""
    model = LSTMClassifier({"words": 30}, embedding_dim=3, hidden=4)
    generator = torch.Generator().manual_seed(2)
    params = model.init(generator, torch.float64)
    params.tables["words"].requires_grad_(True)
    lengths = np.array(lengths)
    k = len(lengths)
    dense = {
        n: (p + 0.3 * torch.randn(k, *p.shape, generator=generator, dtype=p.dtype))
        .detach()
        .requires_grad_(True)
        for n, p in params.dense.items()
    }
    leaves = [params.tables["words"], *dense.values()]
    weights = torch.randn(lengths.shape, generator=generator, dtype=torch.float64)
    results = []
    for head in (model.cohort_head, model.padded_cohort_head):
        features = cohort_features(model, params, lengths, torch.Generator().manual_seed(3))
        outputs = head(dense, features, None)
        results.append((outputs, torch.autograd.grad((outputs * weights).sum(), leaves)))
    (packed, packed_grads), (padded_outputs, padded_grads) = results
    assert packed.shape == lengths.shape
    torch.testing.assert_close(packed, padded_outputs, rtol=1e-12, atol=1e-12)
    for name, got, expected in zip(["table", *dense], packed_grads, padded_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12, msg=name)
    assert all(g.abs().sum() > 0 for g in packed_grads)  # every parameter is reached
