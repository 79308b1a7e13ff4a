"""Federated evaluation's arithmetic: each client's sums on its own samples, and the global
metrics from everyone's sums, so the server gets them without any sample.

A client reports its held-out loss sum, sample count and correct predictions, the same for its
training samples, and for a binary model the positives and negatives per score bin
(engine/binned_auc.py). Pooled, the test loss and accuracy are exactly those of the pooled
held-out samples; the AUC is the binned one, reported with its bound ``test_auc_bin_error``.
(flower/federated_eval.py carries them as Flower Messages.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from fedsub.data.federated import SampleSet
from fedsub.data.ragged import Ragged
from fedsub.engine.binned_auc import BINS, binned_auc, score_histograms
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.metrics import roc_auc
from fedsub.errors import FedsubError
from fedsub.models.base import Model
from fedsub.submodel.params import Params

SUMS = [f"{p}{k}" for p in ("", "train-") for k in ("num-examples", "loss-sum", "correct")]
Sums = dict[str, int | float | list[int] | list[float]]


def localized(
    samples: SampleSet, rows_of_field: Callable[[str], np.ndarray], client: int
) -> SampleSet:
    """``samples`` with global ids rewritten as positions in the rows received
    (``rows_of_field``: the rows of a field's table); refused when the rows received do not
    hold every id."""
    ids = {}
    for field, ragged in samples.ids.items():
        table_rows = rows_of_field(field)
        local = np.searchsorted(table_rows, ragged.values)
        inside = local < len(table_rows)
        if not inside.all() or not np.array_equal(table_rows[local], ragged.values):
            raise FedsubError(
                f"partition {client}: the rows received for evaluation do not hold every "
                f"row of its samples (field {field!r})"
            )
        ids[field] = Ragged(local.astype(np.int64), ragged.offsets)
    return SampleSet(ids, samples.labels, samples.dense)


def client_sums(
    model: Model,
    held_out: SampleSet,
    train: SampleSet,
    rows_of_field: Callable[[str], np.ndarray],
    params: Params,
    client: int,
) -> Sums:
    """A client's sums on its held-out and training samples under ``params`` (its rows)."""
    evaluator = Evaluator(model, held_out, held_out)
    metrics: Sums = {"partition-id": client}
    for prefix, samples in (("", held_out), ("train-", train)):
        n = len(samples)
        metrics[f"{prefix}num-examples"] = n
        metrics[f"{prefix}loss-sum"] = 0.0
        if model.task != "regression":  # a classifier: its accuracy too
            metrics[f"{prefix}correct"] = 0
        if not n:
            continue
        outputs = evaluator.outputs(params, localized(samples, rows_of_field, client)).double()
        labels = torch.from_numpy(samples.labels).double()
        metrics[f"{prefix}loss-sum"] = float(model.loss(outputs, labels)) * n
        if model.task == "binary":
            metrics[f"{prefix}correct"] = int(((outputs > 0) == (labels > 0.5)).sum())
        elif model.task == "multiclass":
            metrics[f"{prefix}correct"] = int((outputs.argmax(dim=1) == labels).sum())
        if prefix == "" and model.task == "binary":
            positives, negatives = score_histograms(samples.labels, torch.sigmoid(outputs).numpy())
            metrics["auc-positives"] = positives.tolist()
            metrics["auc-negatives"] = negatives.tolist()
    return metrics


def pooled_metrics(
    sums: Sequence[dict[str, float]], histograms: Sequence[tuple[np.ndarray, np.ndarray]]
) -> dict[str, float]:
    """Means over the pooled samples from the clients' ``SUMS``, and the binned AUC from their
    (positives, negatives) histograms when any client sent them."""
    total: dict[str, float] = {}
    for client in sums:
        for key, value in client.items():
            total[key] = total.get(key, 0.0) + value
    result: dict[str, float] = {}
    for prefix, name in (("train-", "train"), ("", "test")):
        n = total.get(f"{prefix}num-examples", 0.0)
        if n:
            result[f"{name}_loss"] = total[f"{prefix}loss-sum"] / n
            if f"{prefix}correct" in total:
                result[f"{name}_accuracy"] = total[f"{prefix}correct"] / n
            result[f"{name}_samples"] = n
    if histograms:
        positives, negatives = np.zeros(BINS, np.int64), np.zeros(BINS, np.int64)
        for p, q in histograms:
            positives += p
            negatives += q
        auc, bound = binned_auc(positives, negatives)
        result["test_auc"], result["test_auc_bin_error"] = auc, bound
    return result


def server_test_metrics(model: Model, params: Params, samples: SampleSet) -> dict[str, float]:
    """Exact metrics of the global model on the server's own test file (``server-test-file``:
    data the server holds, never a client's)."""
    outputs = Evaluator(model, samples, samples).outputs(params, samples).double()
    labels = torch.from_numpy(samples.labels).double()
    metrics = {"server_test_loss": float(model.loss(outputs, labels))}
    if model.task == "binary":
        metrics["server_test_accuracy"] = float(((outputs > 0) == (labels > 0.5)).double().mean())
        metrics["server_test_auc"] = roc_auc(samples.labels, outputs.numpy())
    return metrics
