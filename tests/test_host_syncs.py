"""A round does not stop the GPU: its host reads are counted on the CPU, with the torch kernels
a GPU runs (``fedsub.device.CPU_FAST_PATHS = False``), and stay within
``HOST_READS_PER_ROUND`` (3), with no op whose output size depends on the values (the row
union is ``PendingUnion``, not ``torch.unique``); on a CUDA machine,
``torch.cuda.set_sync_debug_mode`` counts the real synchronisations."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch

import fedsub.device as device_lib
from fedsub.algorithms.aggregation import PendingUnion
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.data.synthetic_sparse import SyntheticSparseOptions, generate
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.engine.loop import RunControl
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.engine.server_round import HOST_READS_PER_ROUND
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.models.registry import build_model
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.submodel.index import SubmodelIndex
from tests.host_reads import READS, HostReads
from tests.test_resume_matrix import OPTIONS, dataset_for

ROUNDS = 4


@pytest.fixture(scope="module")
def data():
    dataset = generate(
        SyntheticSparseOptions(num_users=30, num_items=25, mean_samples_per_user=10), seed=4
    )
    return dataset, SubmodelIndex.build(dataset)


def reads_per_round(data, model, algorithm: str, device, **control) -> list[dict[str, int]]:
    """The host reads of rounds 2..ROUNDS (round 1 also builds the run's cached views)."""
    dataset, index = data
    built = build_algorithm(algorithm, AlgorithmContext(dataset, index, "samples", 6))
    schedule = Schedule(
        ROUNDS, 6, LocalWork(3, 2, ClientStep(0.05)), 0, execution=Execution(device=device)
    )
    marks = []
    with HostReads() as reads:
        train(
            model,
            built,
            dataset,
            index,
            schedule,
            on_round=lambda r: marks.append(reads.counts.copy()),
            control=RunControl(**control),
        )
    return [dict(after - before) for before, after in itertools.pairwise(marks)]


def test_the_detector_counts_host_reads_and_value_shaped_ops():
    t = torch.tensor([1.0, 2.0, 2.0])
    with HostReads() as reads:
        t.sum().item()
        bool(t.any())
        float(t[0])
        t.tolist()
        torch.unique(t)
        torch.repeat_interleave(t, torch.tensor([1, 0, 2]))
        torch.repeat_interleave(t, torch.tensor([1, 0, 2]), output_size=3)  # not counted
        t[t > 1]
        t + 1  # not counted
    assert reads.counts == {
        "item": 1,
        "bool": 1,
        "float": 1,
        "tolist": 1,
        "unique": 1,
        "repeat_interleave without output_size": 1,
        "boolean mask": 1,
    }


@pytest.mark.parametrize(
    "model_of, algorithm, control",
    [
        (lambda rows: EmbeddingLogisticRegression(rows, embedding_dim=4), "fedsubavg", {}),
        (lambda rows: EmbeddingLogisticRegression(rows, embedding_dim=4), "fedavg", {}),
        (SparseLogisticRegression, "fedsubavg", {"max_update_norm": 50.0}),
    ],
    ids=["embedding-lr-fedsubavg", "embedding-lr-fedavg", "sparse-lr-screened"],
)
def test_a_round_of_the_torch_kernels_reads_the_host_at_most_the_documented_times(
    monkeypatch, data, model_of, algorithm, control
):
    monkeypatch.setattr(device_lib, "CPU_FAST_PATHS", False)
    model = model_of(dict(data[0].table_rows))
    rounds = reads_per_round(data, model, algorithm, torch.device("cpu"), **control)
    assert len(rounds) == ROUNDS - 1
    for counts in rounds:
        reads = sum(n for kind, n in counts.items() if kind in READS.values())
        assert reads <= HOST_READS_PER_ROUND, counts
        assert set(counts) <= set(READS.values()), counts  # no value-shaped op


def test_two_tables_and_dense_features_keep_the_bound_and_sequence_models_add_one_per_step(
    monkeypatch, tmp_path
):
    """Several tables and fields share the round's reads; DIN's packed history (two tables,
    three fields) reads nothing more; the LSTM reads its tweets' lengths once per local step
    (the packing plan), the documented exception. The LSTM's head then reads its host copy of
    the lengths (``.numpy()``), no device read, which this CPU count also sees."""
    monkeypatch.setattr(device_lib, "CPU_FAST_PATHS", False)
    steps = 3  # reads_per_round's local steps
    for name, allowed, host_copies in [
        ("embedding-lr", HOST_READS_PER_ROUND, 0),
        ("din", HOST_READS_PER_ROUND, 0),
        ("lstm", HOST_READS_PER_ROUND + steps, steps),
    ]:
        dataset, index = dataset_for(name, str(tmp_path))
        model = build_model(name, dataset, {**OPTIONS, "widths": []})
        rounds = reads_per_round((dataset, index), model, "fedsubavg", torch.device("cpu"))
        for counts in rounds:
            assert set(counts) <= set(READS.values()), counts
            assert counts.get("numpy", 0) == host_copies, (name, counts)
            assert sum(counts.values()) - host_copies <= allowed, (name, counts)


def test_a_member_screened_out_still_works_with_the_deferred_checks(monkeypatch, data):
    """The rare path: a norm bound every update exceeds rejects every member; the model
    stays as it was and the rejections are reported."""
    monkeypatch.setattr(device_lib, "CPU_FAST_PATHS", False)
    dataset, index = data
    model = EmbeddingLogisticRegression(dict(dataset.table_rows), embedding_dim=4)
    built = build_algorithm("fedsubavg", AlgorithmContext(dataset, index, "samples", 6))
    schedule = Schedule(2, 6, LocalWork(3, 2, ClientStep(0.05)), 0)
    rejected = []
    unscreened = train(model, built, dataset, index, schedule)
    screened = train(
        model,
        built,
        dataset,
        index,
        schedule,
        control=RunControl(max_update_norm=1e-12, on_reject=rejected.append),
    )
    initial = initial_params(model, schedule)
    assert len(rejected) == 12  # 6 members, 2 rounds
    assert torch.equal(screened.tables["features"], initial.tables["features"])
    assert torch.equal(screened.dense["weight"], initial.dense["weight"])
    assert not torch.equal(unscreened.tables["features"], initial.tables["features"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_round_synchronises_at_most_the_documented_times(data):
    model = EmbeddingLogisticRegression(dict(data[0].table_rows), embedding_dim=4)
    dataset, index = data
    built = build_algorithm("fedsubavg", AlgorithmContext(dataset, index, "samples", 6))
    schedule = Schedule(
        ROUNDS,
        6,
        LocalWork(3, 2, ClientStep(0.05)),
        0,
        execution=Execution(device=torch.device("cuda")),
    )
    per_round: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train(
                model,
                built,
                dataset,
                index,
                schedule,
                on_round=lambda r: per_round.append(
                    sum("synchroniz" in str(w.message) for w in caught)
                ),
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = np.diff(per_round)
    assert (syncs <= HOST_READS_PER_ROUND).all(), syncs


@pytest.mark.parametrize("seed", range(4))
def test_pending_union_equals_torch_unique(seed):
    rng = np.random.default_rng(seed)
    for size in (0, 1, 7, 300):
        rows = torch.from_numpy(rng.integers(0, max(size // 3, 1), size=size))
        pending = PendingUnion(rows)
        distinct, inverse = pending.finish(int(pending.size))
        want_distinct, want_inverse = torch.unique(rows, sorted=True, return_inverse=True)
        assert torch.equal(distinct, want_distinct)
        assert torch.equal(inverse, want_inverse)
