"""Users' own ``nn.Module``s of the shapes fedsub.models.torch_module must take, for tests."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged


class TwoBags(nn.Module):
    """Two tables read by EmbeddingBags (one given fedsub's offsets whole, one their starts),
    concatenated with the dense features into a small MLP: logits [n]."""

    def __init__(self, rows_a: int = 40, rows_b: int = 9, dense: int = 3, dim: int = 3) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(rows_a, dim, mode="sum", include_last_offset=True)
        self.b = nn.EmbeddingBag(rows_b, dim, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(2 * dim + dense, 4), nn.Tanh(), nn.Linear(4, 1))
        with torch.no_grad():  # rows of the size of the dense weights: every tensor trains
            self.a.weight.mul_(0.3)
            self.b.weight.mul_(0.3)

    def forward(self, batch) -> torch.Tensor:
        a = self.a(*batch.ids["a"])
        values, offsets = batch.ids["b"]
        b = self.b(values, offsets[:-1])
        return self.mlp(torch.cat([a, b, batch.dense], dim=-1)).squeeze(-1)


class SummedEmbeddingsLR(nn.Module):
    """fedsub's built-in ``embedding-lr`` as a plain module: per field the sum of its rows,
    concatenated, then a linear layer (logits [n])."""

    def __init__(self, table_rows: dict[str, int], fields: list[str], dim: int) -> None:
        super().__init__()
        self.fields = fields
        self.tables = nn.ModuleDict(
            {
                t: nn.EmbeddingBag(n, dim, mode="sum", include_last_offset=True)
                for t, n in table_rows.items()
            }
        )
        self.out = nn.Linear(dim * len(fields), 1)

    def forward(self, batch) -> torch.Tensor:
        pooled = [self.tables[f](*batch.ids[f]) for f in self.fields]
        return self.out(torch.cat(pooled, dim=-1)).squeeze(-1)


class SharedItem(nn.Module):
    """One item table (one module) read by two fields, both as bags."""

    def __init__(self, items: int = 25, dim: int = 4) -> None:
        super().__init__()
        self.item = nn.EmbeddingBag(items, dim, mode="sum", include_last_offset=True)
        self.out = nn.Linear(dim, 1)

    def forward(self, batch) -> torch.Tensor:
        target = self.item(*batch.ids["target"])
        history = self.item(*batch.ids["history"])
        return self.out(target * history + target).squeeze(-1)


class MaxBags(TwoBags):
    """Table a pooled by max (an EmbeddingBag mode fedsub calls as it is, functionally)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(40, 3, mode="max", include_last_offset=True)


class MeanByHand(TwoBags):
    """Pools table a by hand with the offsets (a mean): it computes with the ids outside its
    tables, so fedsub cannot split it and runs it whole."""

    def forward(self, batch) -> torch.Tensor:
        values, offsets = batch.ids["a"]
        counts = torch.diff(offsets).clamp(min=1).unsqueeze(-1)
        a = self.a(values, offsets) / counts
        b = self.b(batch.ids["b"][0], batch.ids["b"][1][:-1])
        return self.mlp(torch.cat([a, b, batch.dense], dim=-1)).squeeze(-1)


class BranchesOnValues(TwoBags):
    """Data-dependent control flow: vmap cannot run it (sequential only)."""

    def forward(self, batch) -> torch.Tensor:
        logits = super().forward(batch)
        if float(logits.sum()) > 1e9:
            return logits * 0
        return logits


class DenseClassifier(nn.Module):
    """Dense features only, C class logits [n, C]."""

    def __init__(self, inputs: int, classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inputs, 6), nn.ReLU(), nn.Linear(6, classes))

    def forward(self, batch) -> torch.Tensor:
        return self.net(batch.dense)


class SquaredError(TwoBags):
    """A regression output [n] with its own ``loss`` method (mean squared error)."""

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ((outputs - labels) ** 2).mean()


def single_and_multi_id(seed: int = 0) -> FederatedDataset:
    """A 'user' field with one id per sample (its own table) and a multi-hot 'items' field."""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(8):
        n = int(rng.integers(2, 9))
        user = [[int(rng.integers(12))] for _ in range(n)]
        items = [rng.choice(30, size=rng.integers(0, 4), replace=False).tolist() for _ in range(n)]
        parts.append(
            SampleSet(
                {"user": Ragged.from_lists(user), "items": Ragged.from_lists(items)},
                rng.integers(2, size=n).astype(np.float32),
            )
        )
    return FederatedDataset.from_clients("users-items", {"user": 12, "items": 30}, parts, parts[0])


class UserItems(nn.Module):
    """nn.Embedding for the one-id 'user' field, an EmbeddingBag for 'items' (given starts)."""

    def __init__(self, users: int = 12, items: int = 30, dim: int = 4) -> None:
        super().__init__()
        self.user = nn.Embedding(users, dim)
        self.items = nn.EmbeddingBag(items, dim, mode="sum")
        self.out = nn.Linear(dim, 1)

    def forward(self, batch) -> torch.Tensor:
        user = self.user(batch.ids["user"][0])
        values, offsets = batch.ids["items"]
        return self.out(user * self.items(values, offsets[:-1]) + user).squeeze(-1)


def wrapped_cases():
    """The wrapped modules the model conformance suite checks beside the registered models
    (test_model_capabilities.py, test_conformance_models.py): name -> (module, dataset)."""
    from .test_backends import two_tables_with_dense

    return {
        "torch-module:two-bags": (TwoBags, lambda: two_tables_with_dense(0)),
        "torch-module:user-items": (UserItems, single_and_multi_id),
    }


def wrapped(name: str):
    """The wrapped model of conformance case ``name`` and its dataset (seeded weights)."""
    from fedsub.models.torch_module import wrap

    make_module, make_dataset = wrapped_cases()[name]
    dataset = make_dataset()
    torch.manual_seed(0)
    return wrap(make_module(), dataset), dataset


class AnyData(nn.Module):
    """A module for any dataset, built from it (a config's ``model.module`` factory gets the
    dataset by its ``dataset`` parameter): per table an EmbeddingBag named after it, each
    field's rows summed, concatenated with the dense features into a linear layer; logits
    [n] for 0/1 labels, [n, C] for class labels. ``prefix``: the tables' modules are named
    ``prefix + table`` (then only ``tables=`` says which is which)."""

    def __init__(self, dataset: FederatedDataset, dim: int = 3, prefix: str = "") -> None:
        super().__init__()
        self.fields = {f: prefix + dataset.field_tables.get(f, f) for f in dataset.train.ids}
        self.tables = nn.ModuleDict(
            {
                prefix + t: nn.EmbeddingBag(n, dim, mode="sum", include_last_offset=True)
                for t, n in dataset.table_rows.items()
            }
        )
        labels = np.concatenate([dataset.train.labels, dataset.test.labels])
        self.outputs = 1 if np.isin(labels, (0.0, 1.0)).all() else int(labels.max()) + 1
        inputs = dim * len(self.fields) + dataset.train.dense_dim
        self.out = nn.Linear(inputs, self.outputs)

    def forward(self, batch) -> torch.Tensor:
        parts = [self.tables[t](*batch.ids[f]) for f, t in self.fields.items()]
        if batch.dense is not None:
            parts.append(batch.dense)
        logits = self.out(torch.cat(parts, dim=-1))
        return logits.squeeze(-1) if self.outputs == 1 else logits


ANY_DATA = "tests.torch_modules:AnyData"  # its config path (the repository root on sys.path)


class Float64Head(AnyData):
    """``AnyData`` whose output layer is float64 and fed float64: it runs only when fedsub
    trains in float64 (``execution.dtype``)."""

    def __init__(self, dataset: FederatedDataset, dim: int = 3) -> None:
        super().__init__(dataset, dim)
        self.out = self.out.double()

    def forward(self, batch) -> torch.Tensor:
        parts = [self.tables[t](*batch.ids[f]) for f, t in self.fields.items()]
        logits = self.out(torch.cat(parts, dim=-1).double())
        return logits.squeeze(-1) if self.outputs == 1 else logits


FLOAT64_HEAD = "tests.torch_modules:Float64Head"
