"""Evaluation of the global model: train loss on a fixed sample, test loss / accuracy / AUC."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.engine.metrics import roc_auc
from fedsub.models.base import Batch, EvalBatch, Model, forward
from fedsub.numerics import seeding
from fedsub.progress import phase
from fedsub.submodel.params import Params

CHUNK = 65_536


def eval_chunks(model: Model, samples: SampleSet) -> list[SampleSet]:
    """``samples`` in the consecutive chunks the model is evaluated on (``EvalBatch``'s size,
    else ``CHUNK``): each chunk's outputs do not depend on how the others are computed."""
    chunk = model.eval_batch if isinstance(model, EvalBatch) else CHUNK
    return [
        samples.slice(start, min(start + chunk, len(samples)))
        for start in range(0, len(samples), chunk)
    ]


@dataclass(frozen=True)
class Evaluator:
    """Fixed evaluation sets, chosen once so that every round and algorithm is measured alike."""

    model: Model
    train_subset: SampleSet
    test: SampleSet
    extra: Callable[[Params], dict[str, float]] | None = None  # e.g. gradient norms
    # l2 ||w||^2 added to the train loss (eval.regularized_loss: the objective whose gradient
    # train.weight_decay adds, l2 = weight_decay / 2); the gaps stay the plain losses'
    l2: float = 0.0
    # the evaluation sets as tensor batches per (set, device, dtype), built on first use: the
    # same every evaluation, so a GPU run copies them there once
    batches: dict[tuple, tuple[SampleSet, list[Batch]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    # the model's outputs on a set computed elsewhere (row-sharded tables: each process scores
    # its share of the chunks, fedsub/sharding/evaluation.py); None: ``forward`` on ``params``
    outputs_of: Callable[[Params, SampleSet], torch.Tensor] | None = field(
        default=None, compare=False, repr=False
    )

    @staticmethod
    def build(
        model: Model,
        dataset: FederatedDataset,
        train_samples: int,
        seed: int,
        extra: Callable[[Params], dict[str, float]] | None = None,
        l2: float = 0.0,
    ) -> Evaluator:
        n = len(dataset.train)
        if train_samples >= n:
            subset = np.arange(n)
        else:
            generator = seeding.rng(seed, seeding.EVALUATION)
            subset = np.sort(generator.choice(n, size=train_samples, replace=False))
        return Evaluator(model, dataset.train.take(subset), dataset.test, extra, l2)

    def outputs(self, params: Params, samples: SampleSet) -> torch.Tensor:
        if self.outputs_of is not None:
            return self.outputs_of(params, samples)
        with torch.no_grad():
            batches = self._batches(samples, params.tensors()[0].dtype, params.device)
            return torch.cat([forward(self.model, params, batch) for batch in batches])

    def _batches(self, samples: SampleSet, dtype: torch.dtype, device: torch.device) -> list[Batch]:
        key = (id(samples), str(device), dtype)
        cached = self.batches.get(key)
        if cached is None or cached[0] is not samples:
            parts = eval_chunks(self.model, samples)
            cached = (samples, [Batch.from_samples(p, dtype, device) for p in parts])
            self.batches[key] = cached
        return cached[1]

    def evaluate(self, params: Params) -> dict[str, float]:
        """Losses and accuracies on the clients' training data (the fixed subset) and the test
        set, and the generalization gaps (train - test) seed 003 reports."""
        with phase("evaluating"):
            return self._evaluate(params)

    def _evaluate(self, params: Params) -> dict[str, float]:
        train = self._scores(params, self.train_subset, auc=False)
        metrics = {"train_loss": train["loss"] + self.penalty(params)}
        if "accuracy" in train:
            metrics["train_accuracy"] = train["accuracy"]
        if len(self.test):
            test = self._scores(params, self.test, auc=True)
            metrics["test_loss"] = test["loss"]
            for key in ("accuracy", "auc"):
                if key in test:
                    metrics[f"test_{key}"] = test[key]
            metrics["gap_loss"] = train["loss"] - test["loss"]
            if "accuracy" in train:
                metrics["gap_accuracy"] = train["accuracy"] - test["accuracy"]
        if self.extra is not None:
            metrics.update(self.extra(params))
        return metrics

    def penalty(self, params: Params) -> float:
        """l2 ||w||^2 over every parameter (0 unless eval.regularized_loss)."""
        if not self.l2:
            return 0.0
        with torch.no_grad():
            return self.l2 * sum(float(t.double().pow(2).sum()) for t in params.tensors())

    def _scores(self, params: Params, samples: SampleSet, auc: bool) -> dict[str, float]:
        outputs = self.outputs(params, samples)
        labels = torch.from_numpy(samples.labels).to(outputs.device, outputs.dtype)
        with torch.no_grad():
            scores = {"loss": float(self.model.loss(outputs, labels))}
        outputs = outputs.cpu()  # metrics are reporting: numpy from here
        if self.model.task == "binary":
            logits = outputs.double().numpy()
            scores["accuracy"] = float(np.mean((logits > 0) == (samples.labels > 0.5)))
            if auc:
                scores["auc"] = roc_auc(samples.labels, logits)
        elif self.model.task == "multiclass":
            predicted = outputs.argmax(dim=1).numpy()
            scores["accuracy"] = float(np.mean(predicted == samples.labels))
        return scores
