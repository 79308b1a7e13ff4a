"""Amazon loaders in the authors' formats, and DIN: shapes, a learning step, both backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedsub.device as device_lib
from fedsub.data.amazon import (
    AmazonFilesOptions,
    AmazonRatingsOptions,
    load_fedsubavg_files,
    load_ratings_csv,
)
from fedsub.errors import DataError
from fedsub.models import din as din_module
from fedsub.models import packed as packed_module
from fedsub.models.base import Batch, cohort_features, forward
from fedsub.models.cohort_ops import linear
from fedsub.models.din import ATTENTION, DIN, HIDDEN
from fedsub.models.packed import BLOCK, ClientBlocks, ClientGroups, client_rows
from fedsub.models.pooling import attention_pool, padded, sum_pool
from fedsub.submodel.index import SubmodelIndex

from .conftest import assert_backends_agree, assert_one_step_lowers_loss


def write_user_files(folder, users=6, lines=10, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir()
    for u in range(users):
        rows = []
        for _ in range(lines):
            history = rng.choice(np.arange(100, 140), size=rng.integers(0, 4), replace=False)
            text = ",".join(map(str, history)) if len(history) else "0"
            rows.append(f"{rng.integers(2)}\t{u + 7}\t{rng.integers(100, 140)}\t{text}")
        (folder / f"user_{u + 7}").write_text("\n".join(rows) + "\n")
    return folder


def test_fedsubavg_files_hold_out_each_users_last_20_percent(tmp_path):
    folder = write_user_files(tmp_path / "amazon", users=4, lines=10)
    dataset = load_fedsubavg_files(AmazonFilesOptions(), str(folder), 0)
    assert dataset.num_clients == 4 and list(dataset.sample_counts()) == [8] * 4
    assert len(dataset.test) == 8
    assert dataset.field_tables == {"user": "user", "item": "item", "history": "item"}
    first_file = sorted(folder.glob("user_*"))[0]  # clients are numbered in file order
    lines = first_file.read_text().splitlines()
    first = dataset.client(0)
    histories = [
        first.ids["history"].values[a:b]
        for a, b in zip(
            first.ids["history"].offsets[:-1], first.ids["history"].offsets[1:], strict=True
        )
    ]
    for line, hist, label in zip(lines[:8], histories, first.labels, strict=True):
        raw = line.split("\t")
        assert float(raw[0]) == label
        assert len(hist) == (0 if raw[3] == "0" else len(raw[3].split(",")))


def test_bad_user_file_line_is_named(tmp_path):
    folder = write_user_files(tmp_path / "amazon", users=2, lines=3)
    (folder / "user_8").write_text("1\t8\t120\n")
    with pytest.raises(DataError, match=r"user_8, line 1: expected 4 tab-separated fields"):
        load_fedsubavg_files(AmazonFilesOptions(), str(folder), 0)


def test_ratings_csv_click_history_and_time_split(tmp_path):
    rows = [
        "a,i1,5,100",
        "a,i2,3,200",
        "a,i3,5,300",
        "a,i4,5,1385000001",
        "b,i1,5,100",
    ]  # b has too few ratings
    path = tmp_path / "ratings.csv"
    path.write_text("\n".join(rows) + "\n")
    dataset = load_ratings_csv(AmazonRatingsOptions(min_ratings=4), str(path), 0)
    assert dataset.num_clients == 1 and len(dataset.train) == 3 and len(dataset.test) == 1
    hist = dataset.train.ids["history"]
    assert hist.lengths().tolist() == [0, 1, 1]  # i1 clicked before i2 and i3; i2 was not
    assert dataset.train.labels.tolist() == [1.0, 0.0, 1.0]
    assert dataset.test.ids["history"].lengths().tolist() == [2]  # i1, i3


def test_padded_history_matches_the_lists():
    weight = torch.arange(12.0).reshape(6, 2)
    values, offsets = torch.tensor([3, 1, 5, 2]), torch.tensor([0, 2, 2, 4])
    rows, mask = padded(weight, values, offsets)
    assert rows.shape == (3, 2, 2) and mask.tolist() == [[True, True], [False, False], [True, True]]
    torch.testing.assert_close(rows[2], weight[[5, 2]])


@pytest.fixture(scope="module")
def amazon(tmp_path_factory):
    folder = write_user_files(tmp_path_factory.mktemp("a") / "amazon", users=8, lines=12)
    dataset = load_fedsubavg_files(AmazonFilesOptions(), str(folder), 0)
    return dataset, SubmodelIndex.build(dataset)


def test_din_shapes_and_one_step_lowers_the_loss(amazon):
    dataset, _ = amazon
    model = DIN(dict(dataset.table_rows), embedding_dim=6, init_std=0.1)
    params = model.init(torch.Generator().manual_seed(0), torch.float64)
    batch = Batch.from_samples(dataset.train.take(np.arange(16)), torch.float64)
    features = model.embed(params.tables, batch.ids)
    lengths = batch.ids["history"][1].diff()
    assert features["history"].shape == (int(lengths.sum()), 6)  # packed: no padding
    assert torch.equal(features["history_lengths"], lengths)
    assert features["user"].shape == (16, 6)
    assert forward(model, params, batch).shape == (16,)
    assert_one_step_lowers_loss(model, params, batch, lr=0.5)


def test_din_batched_equals_sequential(amazon):
    dataset, index = amazon
    model = DIN(dict(dataset.table_rows), embedding_dim=4, init_std=0.3)
    assert_backends_agree(
        model, dataset, index, "fedsubavg", 4, local_steps=3, seed=2, clip_norm=5.0
    )


# --- the packed history against the padded form DIN had before (kept here as the reference) ---


def padded_cohort_head(dense, tables, ids, k):
    """DIN as it was computed before the packed history: every history padded to the batch's
    longest, the attention MLP on [q, k, q - k, q * k] over all the slots, padding masked
    with -1e9 before the softmax."""
    history, mask = padded(tables["item"], *ids["history"])
    user, item = sum_pool(tables["user"], *ids["user"]), sum_pool(tables["item"], *ids["item"])
    user, item = user.reshape(k, -1, user.shape[-1]), item.reshape(k, -1, item.shape[-1])
    history = history.reshape(k, -1, *history.shape[1:])
    mask = mask.reshape(k, -1, mask.shape[-1])
    query = item.unsqueeze(2).expand_as(history)
    x = torch.cat([query, history, query - history, query * history], dim=-1)
    for i in range(len(ATTENTION)):
        x = linear(x, dense[f"att{i}.weight"], dense[f"att{i}.bias"])
        if i < len(ATTENTION) - 1:
            x = torch.sigmoid(x)
    scores = x.squeeze(-1).masked_fill(~mask, -1e9)
    weights = torch.softmax(scores, dim=-1) * mask
    attended = (weights.unsqueeze(-1) * history).sum(2)
    pooled = (history * mask.unsqueeze(-1)).sum(2)
    x = torch.cat([user, item, pooled, item * pooled, attended], dim=-1)
    for i in range(len(HIDDEN)):
        x = linear(x, dense[f"fc{i}.weight"], dense[f"fc{i}.bias"])
        if i < len(HIDDEN) - 1:
            x = written_dice(x, dense[f"fc{i}.alpha"].unsqueeze(1))
    return x[..., 1] - x[..., 0]


def written_dice(x, alpha, eps=1e-9):
    """The authors' Dice.py written out (torch, for gradients): per client (dim 1 = its batch),
    std = sqrt(mean((x - mean)^2 + eps)), p = sigmoid((x - mean) / (std + eps)),
    out = alpha (1 - p) x + p x."""
    mean = x.mean(dim=1, keepdim=True)
    std = torch.sqrt(((x - mean) ** 2 + eps).mean(dim=1, keepdim=True))
    p = torch.sigmoid((x - mean) / (std + eps))
    return alpha * (1.0 - p) * x + p * x


def ragged_ids(generator, lengths, rows):
    """(values, offsets) of random ids in [0, rows) with the given list lengths."""
    lengths = torch.tensor(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return torch.randint(0, rows, (int(lengths.sum()),), generator=generator), offsets


# client 0 spans several blocks, client 1 has no history at all, client 2 a sample without
LENGTHS = {
    "several clients": [[40, 3, 0, 17], [0, 0, 0, 0], [0, 5, 1, 2], [BLOCK, 1, 0, 9]],
    "one client": [[7, 0, 23, 1]],
    "no history": [[0, 0], [0, 0]],
}


@pytest.mark.parametrize("rows_per_pass", [din_module.ROWS_PER_PASS, 7])
@pytest.mark.parametrize("case", LENGTHS)
def test_packed_din_equals_the_padded_form_and_its_gradients(case, rows_per_pass, monkeypatch):
    """Outputs and every gradient (tables and the K clients' dense parameters), float64; one
    client's rows scored in one pass or in pieces of 7."""
    monkeypatch.setattr(din_module, "ROWS_PER_PASS", rows_per_pass)
    lengths = LENGTHS[case]
    k, b = len(lengths), len(lengths[0])
    model = DIN({"user": 5, "item": 30}, embedding_dim=4, init_std=0.5)
    generator = torch.Generator().manual_seed(3)
    params = model.init(generator, torch.float64)
    dense = {  # a different dense model per client
        n: (p + 0.3 * torch.randn(k, *p.shape, generator=generator, dtype=p.dtype))
        for n, p in params.dense.items()
    }
    ids = {
        "user": ragged_ids(generator, [1] * (k * b), 5),
        "item": ragged_ids(generator, [1] * (k * b), 30),
        "history": ragged_ids(generator, [n for row in lengths for n in row], 30),
    }
    leaves = [*params.tables.values(), *dense.values()]
    for leaf in leaves:
        leaf.requires_grad_(True)
    features = cohort_features(model.embed(params.tables, ids), k, model.packed_features)
    got = model.cohort_head(dense, features, None)
    expected = padded_cohort_head(dense, params.tables, ids, k)
    assert got.shape == (k, b)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    probe = torch.randn(k, b, generator=generator, dtype=torch.float64)
    got_grads = torch.autograd.grad((got * probe).sum(), leaves, allow_unused=True)
    expected_grads = torch.autograd.grad((expected * probe).sum(), leaves, allow_unused=True)
    for mine, reference in zip(got_grads, expected_grads, strict=True):
        if reference is None:
            assert mine is None or not mine.any()
        else:
            torch.testing.assert_close(mine, reference, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fast_paths", [True, False], ids=["exact-count", "bound"])
def test_client_blocks_apply_each_clients_weights_to_its_rows(fast_paths, monkeypatch):
    """Against a loop of one matmul per client; rows spanning blocks, an empty client, and
    (without the CPU's fast path, as on a GPU) idle blocks at the end: the block count is a
    bound. A per-slot addend goes to its own row."""
    monkeypatch.setattr(device_lib, "CPU_FAST_PATHS", fast_paths)
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([2 * BLOCK + 3, 0, 1, BLOCK])
    rows = torch.randn(int(counts.sum()), 5, generator=generator, dtype=torch.float64)
    weight = torch.randn(4, 5, 3, generator=generator, dtype=torch.float64)
    bias = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    added = torch.randn(len(rows), 3, generator=generator, dtype=torch.float64)
    blocks = ClientBlocks.of(counts, len(rows))
    used = 3 + 0 + 1 + 1  # blocks the clients fill
    assert blocks.block_owner is not None
    assert len(blocks.block_owner) == used if fast_paths else len(blocks.block_owner) > used
    got = blocks.from_slots(blocks.linear(blocks.to_slots(rows), weight, bias))
    parts = rows.split(counts.tolist())
    expected = torch.cat([p @ weight[c] + bias[c] for c, p in enumerate(parts)])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    with_added = blocks.linear(blocks.to_slots(rows), weight, bias, blocks.to_slots(added))
    torch.testing.assert_close(
        blocks.from_slots(with_added), expected + added, rtol=1e-12, atol=1e-12
    )
    one = ClientBlocks.of(counts[:1], int(counts[0]))
    torch.testing.assert_close(one.linear(parts[0], weight[:1]), parts[0] @ weight[0])


needs_grouped_mm = pytest.mark.skipif(
    packed_module._GROUPED_MM is None, reason="this torch has no grouped matmul"
)


@needs_grouped_mm
@pytest.mark.parametrize(
    "fan_out", [1, 3, 8], ids=["a dot per row", "a product per row", "grouped matmul"]
)
def test_client_groups_apply_each_clients_weights_to_its_rows(fan_out):
    """Float32, against a loop of one float64 matmul per client (an empty client, one client
    with a single row): outputs and the gradients of rows, weights, biases and the per-row
    addend; 1 and 3 outputs are not 16-byte rows, so they take a product per row."""
    generator = torch.Generator().manual_seed(1)
    counts = torch.tensor([37, 0, 1, 20])
    rows = torch.randn(int(counts.sum()), 8, generator=generator, dtype=torch.float64)
    weight = torch.randn(4, 8, fan_out, generator=generator, dtype=torch.float64)
    bias = torch.randn(4, fan_out, generator=generator, dtype=torch.float64)
    added = torch.randn(len(rows), fan_out, generator=generator, dtype=torch.float64)
    probe = torch.randn(len(rows), fan_out, generator=generator, dtype=torch.float64)
    inputs = [rows, weight, bias, added]

    def expected_of(rows, weight, bias, added):
        parts = rows.split(counts.tolist())
        return torch.cat([p @ weight[c] + bias[c] for c, p in enumerate(parts)]) + added

    def grouped_of(rows, weight, bias, added):
        groups = client_rows(counts, rows)
        assert isinstance(groups, ClientGroups)
        return groups.from_slots(groups.linear(groups.to_slots(rows), weight, bias, added))

    results, threads = [], torch.get_num_threads()
    torch.set_num_threads(2)  # the grouped kernel runs on one thread and gives them back
    try:
        for function, dtype in ((expected_of, torch.float64), (grouped_of, torch.float32)):
            leaves = [t.to(dtype).requires_grad_(True) for t in inputs]
            out = function(*leaves)
            grads = torch.autograd.grad((out * probe.to(dtype)).sum(), leaves)
            results.append([out, *grads])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    for reference, got in zip(*results, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5)
    assert not results[1][2][1].any()  # the empty client's weight gradient


def test_client_rows_groups_on_the_cpu_in_float32_only(monkeypatch):
    counts = torch.tensor([2, 3])
    rows32 = torch.zeros(5, 4)
    if packed_module._GROUPED_MM is not None:
        assert isinstance(client_rows(counts, rows32), ClientGroups)
    assert isinstance(client_rows(counts, rows32.double()), ClientBlocks)
    assert isinstance(client_rows(counts[:1], rows32[:2]), ClientBlocks)
    monkeypatch.setattr(device_lib, "CPU_FAST_PATHS", False)  # as on a GPU
    assert isinstance(client_rows(counts, rows32), ClientBlocks)


@needs_grouped_mm
def test_din_float32_rounds_on_client_groups_agree_with_client_blocks(amazon, monkeypatch):
    """Batched float32 rounds on the grouped layout (checked: it was used) train the model the
    block layout trains, up to float32 rounding (the weight gradients' sums are ordered
    differently), both within float32 rounding of the sequential per-client loop's."""
    from fedsub.engine.execution import Execution
    from fedsub.engine.in_process import train
    from fedsub.engine.schedule import ClientStep, LocalWork, Schedule

    from .equivalence import algorithm_for

    dataset, index = amazon
    model = DIN(dict(dataset.table_rows), embedding_dim=4, init_std=0.3)
    used, layout_of = [], packed_module.client_rows

    def spy(*args):
        used.append(type(layout := layout_of(*args)))
        return layout

    monkeypatch.setattr(din_module, "client_rows", spy)

    def run(backend, dtype):
        execution = Execution(backend=backend, dtype=dtype)
        schedule = Schedule(
            2, 4, LocalWork(2, 4, ClientStep(0.2, clip_norm=5.0)), 2, execution=execution
        )
        algorithm = algorithm_for("fedsubavg", dataset, index, 4)
        trained = train(model, algorithm, dataset, index, schedule)
        return {n: v.double() for n, v in trained.state_dict().items()}

    grouped = run("batched", torch.float32)
    assert used and set(used) == {ClientGroups}
    monkeypatch.setattr(packed_module, "_GROUPED_MM", None)
    blocks = run("batched", torch.float32)
    assert set(used) == {ClientGroups, ClientBlocks}
    reference = run("sequential", torch.float32)
    for name, value in reference.items():
        scale = max(float(value.abs().max()), 1.0)
        for other in (grouped, blocks):
            assert float((other[name] - value).abs().max() / scale) < 1e-5, name
    assert any(not torch.equal(grouped[n], blocks[n]) for n in grouped)  # two computations


def test_attention_pool_is_a_softmax_over_each_samples_rows_only():
    generator = torch.Generator().manual_seed(1)
    lengths = torch.tensor([3, 0, 1, 4])
    rows = torch.randn(8, 2, generator=generator, dtype=torch.float64)
    scores = 50 * torch.randn(8, generator=generator, dtype=torch.float64)  # exp would overflow
    sample = torch.repeat_interleave(torch.arange(4), lengths)
    got = attention_pool(rows, scores, lengths, sample)
    expected = []
    for part, s in zip(rows.split(lengths.tolist()), scores.split(lengths.tolist()), strict=True):
        weights = torch.softmax(s, 0) if len(s) else s
        expected.append((weights.unsqueeze(1) * part).sum(0))
    torch.testing.assert_close(got, torch.stack(expected), rtol=1e-12, atol=1e-12)


def test_evaluation_of_the_packed_din_gives_the_padded_forms_metrics(amazon):
    """The evaluator's metrics (one client, the whole test set in one chunk, Dice over it)
    against the padded form's outputs, with scikit-learn's AUC."""
    from sklearn.metrics import roc_auc_score

    from fedsub.engine.evaluate import Evaluator

    dataset, _ = amazon
    model = DIN(dict(dataset.table_rows), embedding_dim=4, init_std=0.5)
    params = model.init(torch.Generator().manual_seed(5), torch.float64)
    metrics = Evaluator.build(model, dataset, 30, 0).evaluate(params)
    batch = Batch.from_samples(dataset.test, torch.float64)
    dense = {n: p.unsqueeze(0) for n, p in params.dense.items()}
    logits = padded_cohort_head(dense, params.tables, batch.ids, 1)[0]
    labels = torch.from_numpy(dataset.test.labels).double()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    assert metrics["test_loss"] == pytest.approx(float(loss), rel=1e-12)
    assert metrics["test_auc"] == pytest.approx(roc_auc_score(labels, logits), rel=1e-12)
    accuracy = float(((logits > 0).double() == labels).double().mean())
    assert metrics["test_accuracy"] == pytest.approx(accuracy, rel=1e-12)


def test_dice_is_the_authors_formula():
    """fedsub's Dice against Dice.py written out in numpy: a batch's mean and std per unit,
    epsilon 1e-9 inside the root and beside it; a batch of identical rows (variance 0) gates
    at exactly 1/2."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 4, 5)) * np.array([1.0, 1e-3, 10.0, 1.0, 1e-6])
    x[2] = x[2, :1]  # a client whose 4 samples are identical
    alpha = rng.normal(size=(3, 1, 5))
    mean = x.mean(axis=1, keepdims=True)
    std = np.sqrt(np.mean((x - mean) ** 2 + 1e-9, axis=1, keepdims=True))
    p = 1 / (1 + np.exp(-(x - mean) / (std + 1e-9)))
    expected = alpha * (1 - p) * x + p * x
    got = din_module.dice(torch.from_numpy(x), torch.from_numpy(alpha)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(got[2], (0.5 * alpha[2] + 0.5) * x[2], rtol=1e-12)


def test_din_scores_a_test_sample_within_its_batch_of_1024(tmp_path):
    """As the authors evaluate (test_batch_size 1,024): a test sample's score is the model's
    output on the fixed batch of 1,024 it falls in, whatever the samples of other batches."""
    from fedsub.engine.evaluate import Evaluator

    folder = write_user_files(tmp_path / "amazon", users=5, lines=600, seed=3)
    dataset = load_fedsubavg_files(AmazonFilesOptions(), str(folder), 0)
    model = DIN(dict(dataset.table_rows), embedding_dim=4, init_std=0.3)
    assert model.eval_batch == 1024 and len(dataset.train) > 2 * 1024
    params = model.init(torch.Generator().manual_seed(1), torch.float64)
    evaluator = Evaluator.build(model, dataset, 10**6, 0)
    samples = dataset.train
    scores = evaluator.outputs(params, samples)
    for start in (0, 1024, 2048):
        batch = samples.slice(start, min(start + 1024, len(samples)))
        alone = forward(model, params, Batch.from_samples(batch, torch.float64))
        torch.testing.assert_close(scores[start : start + len(batch)], alone, rtol=0, atol=1e-12)
    whole = forward(model, params, Batch.from_samples(samples, torch.float64))
    assert not torch.allclose(whole, scores)  # one chunk of everything would score otherwise
