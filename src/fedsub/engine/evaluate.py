"""Evaluation of the global model: train loss on a fixed sample, test loss / accuracy / AUC."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.engine import seeding
from fedsub.engine.metrics import roc_auc
from fedsub.models.base import Batch, Model, forward
from fedsub.submodel.params import Params

CHUNK = 65_536


@dataclass(frozen=True)
class Evaluator:
    """Fixed evaluation sets, chosen once so that every round and algorithm is measured alike."""

    model: Model
    train_subset: SampleSet
    test: SampleSet
    extra: Callable[[Params], dict[str, float]] | None = None  # e.g. gradient norms

    @staticmethod
    def build(
        model: Model,
        dataset: FederatedDataset,
        train_samples: int,
        seed: int,
        extra: Callable[[Params], dict[str, float]] | None = None,
    ) -> Evaluator:
        n = len(dataset.train)
        if train_samples >= n:
            subset = np.arange(n)
        else:
            generator = seeding.rng(seed, seeding.EVALUATION)
            subset = np.sort(generator.choice(n, size=train_samples, replace=False))
        return Evaluator(model, dataset.train.take(subset), dataset.test, extra)

    def outputs(self, params: Params, samples: SampleSet) -> torch.Tensor:
        dtype = params.tensors()[0].dtype
        chunks = []
        with torch.no_grad():
            for start in range(0, len(samples), CHUNK):
                part = samples.slice(start, min(start + CHUNK, len(samples)))
                chunks.append(forward(self.model, params, Batch.from_samples(part, dtype)))
        return torch.cat(chunks)

    def loss(self, params: Params, samples: SampleSet) -> float:
        outputs = self.outputs(params, samples)
        labels = torch.from_numpy(samples.labels).to(outputs.dtype)
        with torch.no_grad():
            return float(self.model.loss(outputs, labels))

    def evaluate(self, params: Params) -> dict[str, float]:
        metrics = {"train_loss": self.loss(params, self.train_subset)}
        if len(self.test):
            outputs = self.outputs(params, self.test)
            labels = torch.from_numpy(self.test.labels).to(outputs.dtype)
            with torch.no_grad():
                metrics["test_loss"] = float(self.model.loss(outputs, labels))
            if self.model.task == "binary":
                scores = outputs.double().numpy()
                metrics["test_accuracy"] = float(np.mean((scores > 0) == (self.test.labels > 0.5)))
                metrics["test_auc"] = roc_auc(self.test.labels, scores)
            elif self.model.task == "multiclass":
                predicted = outputs.argmax(dim=1).numpy()
                metrics["test_accuracy"] = float(np.mean(predicted == self.test.labels))
        if self.extra is not None:
            metrics.update(self.extra(params))
        return metrics
