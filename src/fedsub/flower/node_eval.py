"""The node half of federated evaluation (flower/federated_eval.py): a node scores the
global model's rows on its own held-out and training samples and reports sums only."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord

from fedsub.data.federated import SampleSet
from fedsub.data.ragged import Ragged
from fedsub.engine.binned_auc import score_histograms
from fedsub.engine.evaluate import Evaluator
from fedsub.errors import FedsubError
from fedsub.flower.node_data import NodeData
from fedsub.submodel.params import Params


def eval_index_record(node: NodeData) -> ArrayRecord:
    return ArrayRecord({f"rows.{t}": torch.from_numpy(r) for t, r in node.eval_rows().items()})


def localized(samples: SampleSet, rows: dict[str, torch.Tensor], node: NodeData) -> SampleSet:
    """``samples`` with global ids rewritten as positions in the rows received; refused
    when the rows received do not hold every id."""
    ids = {}
    for field, ragged in samples.ids.items():
        table_rows = rows[node.table_of(field)].numpy()
        local = np.searchsorted(table_rows, ragged.values)
        inside = local < len(table_rows)
        if not inside.all() or not np.array_equal(table_rows[local], ragged.values):
            raise FedsubError(
                f"partition {node.client}: the rows received for evaluation do not hold every "
                f"row of its samples (field {field!r})"
            )
        ids[field] = Ragged(local.astype(np.int64), ragged.offsets)
    return SampleSet(ids, samples.labels, samples.dense)


def node_report(node: NodeData, rows: dict[str, torch.Tensor], params: Params) -> MetricRecord:
    """The node's sums on its held-out and training samples under ``params`` (its rows)."""
    evaluator = Evaluator(node.model, node.held_out, node.held_out)
    metrics: dict[str, int | float | list[int] | list[float]] = {"partition-id": node.client}
    for prefix, samples in (("", node.held_out), ("train-", node.train)):
        n = len(samples)
        metrics[f"{prefix}num-examples"] = n
        metrics[f"{prefix}loss-sum"] = 0.0
        if node.model.task != "regression":  # a classifier: its accuracy too
            metrics[f"{prefix}correct"] = 0
        if not n:
            continue
        outputs = evaluator.outputs(params, localized(samples, rows, node)).double()
        labels = torch.from_numpy(samples.labels).double()
        metrics[f"{prefix}loss-sum"] = float(node.model.loss(outputs, labels)) * n
        if node.model.task == "binary":
            metrics[f"{prefix}correct"] = int(((outputs > 0) == (labels > 0.5)).sum())
        elif node.model.task == "multiclass":
            metrics[f"{prefix}correct"] = int((outputs.argmax(dim=1) == labels).sum())
        if prefix == "" and node.model.task == "binary":
            positives, negatives = score_histograms(samples.labels, torch.sigmoid(outputs).numpy())
            metrics["auc-positives"] = positives.tolist()
            metrics["auc-negatives"] = negatives.tolist()
    return MetricRecord(metrics)
