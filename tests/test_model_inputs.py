"""Every model x every shape of dataset: a model either reads the whole dataset (then its loss
on a batch is finite and every id table it needs is there) or is refused before anything is
written, naming the model, what it reads and what the dataset has. The reported crashes were
`din` on table data (KeyError: 'item') and `mlp` on a numeric-only table (KeyError:
'features'), both after the run folder existed; `sparse-lr` on 10 classes trained silently."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsub.data.amazon import AmazonFilesOptions, load_fedsubavg_files
from fedsub.data.sent140 import Sent140Options
from fedsub.data.sent140 import load as load_sent140
from fedsub.data.synthetic_li import SyntheticLiOptions
from fedsub.data.synthetic_li import generate as generate_li
from fedsub.data.synthetic_sparse import SyntheticSparseOptions, generate
from fedsub.data.table import TableOptions
from fedsub.data.table import load as load_table
from fedsub.errors import ConfigError
from fedsub.models.base import Batch, forward
from fedsub.models.registry import build_checked_model, model_names, model_spec

from .test_amazon_din import write_user_files
from .test_backends import two_tables_with_dense
from .test_sent140_lstm import tweets, write_csv
from .torch_modules import ANY_DATA

OPTIONS = {"init_std": 0.1, "embedding_dim": 3, "scaler": True, "module": ANY_DATA}
WIDTHS = {"cnn": [2, 3], "mlp": [5, 4], "resnet18": [2, 2, 2, 2]}
CSV = "user,clicked,city,price\n" + "".join(
    f"u{i % 4},{i % 2},c{i % 3},{i * 1.5}\n" for i in range(24)
)


@cache
def dataset(kind: str, folder: str):
    """One dataset of each shape fedsub loads."""
    root = Path(folder)
    if kind == "ids (synthetic-sparse)":
        return generate(SyntheticSparseOptions(num_users=20, num_items=10), 0)
    if kind == "ids in two tables + dense":
        return two_tables_with_dense(0)
    if kind == "user/item/history (amazon)":
        return load_fedsubavg_files(AmazonFilesOptions(), str(write_user_files(root / "a")), 0)
    if kind == "one token field (sent140)":
        write_csv(root / "t.csv", list(tweets(users=4, per_user=50)))
        return load_sent140(Sent140Options(vocab_size=12, max_tokens=5), str(root / "t.csv"), 0)
    if kind.startswith("dense"):
        dim = {
            "dense 5, 3 classes": 5,
            "dense 8x8 image": 64,
            "dense 16x16 image": 256,
            "dense 3x16x16 colour image": 768,
        }[kind]
        return generate_li(SyntheticLiOptions(num_devices=4, dim=dim, classes=3), 0)
    (root / "c.csv").write_text(CSV)
    features = ["city"] if kind == "table: categorical + numeric" else []
    options = TableOptions("user", "clicked", features=features, numeric=["price"])
    return load_table(options, str(root / "c.csv"), 0)


KINDS = [
    "ids (synthetic-sparse)",
    "ids in two tables + dense",
    "user/item/history (amazon)",
    "one token field (sent140)",
    "dense 5, 3 classes",
    "dense 8x8 image",
    "dense 16x16 image",
    "dense 3x16x16 colour image",
    "table: categorical + numeric",
    "table: numeric only",
]
# What must be refused (the rest must read): the declared inputs, written out by hand.
REFUSED = {("din", k) for k in KINDS if k != "user/item/history (amazon)"} | {
    *(
        ("lstm", k)
        for k in KINDS
        if k not in ("ids (synthetic-sparse)", "one token field (sent140)")
    ),
    *(("embedding-lr", k) for k in KINDS if k.startswith(("dense", "table")) or "+ dense" in k),
    *(("sparse-lr", k) for k in KINDS if k.startswith("dense") or k == "table: numeric only"),
    *(
        (m, k)
        for m in ("mlp", "softmax-regression", "linear-regression")
        for k in KINDS
        if not k.startswith(("dense", "table: numeric"))
    ),
    *(("cnn", k) for k in KINDS if k not in ("dense 16x16 image", "dense 3x16x16 colour image")),
    *(("resnet18", k) for k in KINDS if "image" not in k),
}


def test_every_model_declares_what_it_reads():
    assert all(model_spec(name).reads.describe() for name in model_names())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", model_names())
def test_a_model_reads_all_of_a_dataset_or_is_refused_naming_both(name, kind, tmp_path_factory):
    data = dataset(kind, str(tmp_path_factory.getbasetemp()))
    options = {**OPTIONS, "widths": WIDTHS.get(name, [])}
    if (name, kind) in REFUSED:
        with pytest.raises(ConfigError) as error:
            build_checked_model(name, data, options)
        message = str(error.value)
        assert message.startswith(f"model.name = {name!r} cannot read {data.name}: ")
        assert f"The model reads {model_spec(name).reads.describe()}; the dataset has " in message
        return
    model = build_checked_model(name, data, options)
    params = model.init(torch.Generator().manual_seed(0), torch.float64)
    batch = Batch.from_samples(data.train.take(np.arange(min(6, len(data.train)))), torch.float64)
    loss = model.loss(forward(model, params, batch), batch.labels)
    assert torch.isfinite(loss)
