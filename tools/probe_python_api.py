"""Try the Python API's mistake cases of issue 36 and count how each ends.

Each case is a call a new user might write; it ends as ``ok`` (a fedsub error naming what
the case expects, or a correct run), ``raw`` (an exception that is not a FedsubError),
``silent`` (no error where one was due) or ``unclear`` (a fedsub error missing a word the
case expects, e.g. the argument's name). Run: ``PYTHONPATH=src .venv/bin/python
tools/probe_python_api.py`` (``-v`` prints every case's message).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

import fedsub
from fedsub.errors import FedsubError

warnings.simplefilter("ignore")
logging.getLogger("fedsub").setLevel(logging.ERROR)
SMALL = {"rounds": 1, "clients_per_round": 2, "local_steps": 1, "batch_size": 2}


def data(dense: bool = False, labels: Callable[[int], list[int]] | None = None) -> Any:
    rng = np.random.default_rng(0)
    clients = [
        fedsub.samples(
            labels=(labels or (lambda k: [0, 1, 1, 0]))(k),
            ids={"item": rng.integers(0, 10, size=4)},
            dense=rng.normal(size=(4, 2)) if dense else None,
        )
        for k in range(4)
    ]
    return fedsub.from_clients(clients, test=clients[0], table_rows={"item": 10})


class Bag(nn.Module):
    def __init__(self, outputs: int = 1, last: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.item = nn.EmbeddingBag(10, 3, mode="sum", include_last_offset=last)
        self.out = nn.Linear(3, outputs).to(dtype)
        self.last, self.outputs = last, outputs

    def forward(self, batch: Any) -> torch.Tensor:
        values, offsets = batch.ids["item"]
        pooled = self.item(values, offsets)
        out = self.out(pooled.to(self.out.weight.dtype))
        return out.squeeze(-1) if self.outputs == 1 else out


class DefaultBag(Bag):
    def __init__(self) -> None:
        super().__init__(last=False)


class NaNOut(Bag):
    def forward(self, batch: Any) -> torch.Tensor:
        return super().forward(batch) * float("nan")


def frame() -> Any:
    import pandas as pd

    return pd.DataFrame(
        {
            "user": list("aabbccdd"),
            "item": list("xyxzxyzz"),
            "label": [1, 0, 0, 1, 1, 0, 1, 0],
            "x": [0.1, 0.2, 0.3, 0.1, 0.5, 0.3, 0.2, 0.1],
        }
    )


def big_id() -> Any:
    clients = [fedsub.samples([0, 1], ids={"item": [1, 2]}) for _ in range(2)]
    clients.append(fedsub.samples([0, 1], ids={"item": [1, 10**12]}))
    return fedsub.from_clients(clients)


def sweep_later_bad() -> Any:
    out = tempfile.mkdtemp() + "/s"
    base = {"train": {"rounds": 1, "algorithms": ["fedsubavg"]}}
    return fedsub.sweep(base, "train.clients_per_round", [5, 10**9], out=out)


def overwrite_vocabulary() -> Any:
    out = tempfile.mkdtemp() + "/r"
    config = fedsub.Config.from_dict({"train": {"rounds": 1, "algorithms": ["fedsubavg"]}})
    fedsub.run(config, out=out)
    return fedsub.run(config, out=out)


class Float64Head(Bag):
    def __init__(self) -> None:
        super().__init__(dtype=torch.float64)

    def forward(self, batch: Any) -> torch.Tensor:
        values, offsets = batch.ids["item"]
        return self.out(self.item(values, offsets).double()).squeeze(-1)


class StartsToLastBag(Bag):
    def forward(self, batch: Any) -> torch.Tensor:
        values, offsets = batch.ids["item"]
        return self.out(self.item(values, offsets[:-1])).squeeze(-1)


def sweep_later_unreadable() -> Any:
    out = tempfile.mkdtemp() + "/s"
    base = {"train": {"rounds": 1, "algorithms": ["fedsubavg"], "clients_per_round": 2}}
    return fedsub.sweep(base, "data.name", ["synthetic-sparse", "movielens-1m"], out=out)


def dense_unread() -> Any:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("fedsub")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        fedsub.train(Bag(), data(dense=True), **SMALL)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.ERROR)
    if any("dense" in r for r in records):
        raise FedsubError("warned: " + "; ".join(r for r in records if "dense" in r))
    return "no warning"


def default_bag_trains() -> Any:
    result = fedsub.train(DefaultBag(), data(), **SMALL)
    assert len(result.history) >= 1
    return "ran"


# (name, call, words an error must hold; None: the call must succeed)
CASES: list[tuple[str, Callable[[], Any], list[str] | None]] = [
    ("samples ids=list", lambda: fedsub.samples([0, 1], ids=[1, 2]), ["ids"]),
    ("samples labels=str", lambda: fedsub.samples("01", ids={"a": [1, 2]}), ["labels"]),
    ("samples dense=str", lambda: fedsub.samples([0, 1], dense="x"), ["dense"]),
    ("samples where=int", lambda: fedsub.samples([0, 1], where=3), ["where"]),
    ("from_clients not list", lambda: fedsub.from_clients(5), ["clients"]),
    ("from_clients list of ints", lambda: fedsub.from_clients([1, 2]), ["clients"]),
    (
        "from_clients test=list",
        lambda: fedsub.from_clients([fedsub.samples([0, 1])] * 2, test=[1]),
        ["test"],
    ),
    ("from_dataframe dict", lambda: fedsub.from_dataframe({"user": ["a"]}), ["frame"]),
    (
        "from_dataframe features=str",
        lambda: fedsub.from_dataframe(frame(), client_column="user", features="item"),
        None,
    ),
    (
        "from_dataframe test_fraction<0",
        lambda: fedsub.from_dataframe(
            frame(), client_column="user", features=["item"], test_fraction=-0.1
        ),
        ["test_fraction", "-0.1"],
    ),
    (
        "from_dataframe standardize=yes",
        lambda: fedsub.from_dataframe(
            frame(), client_column="user", numeric=["x"], standardize="yes"
        ),
        ["standardize", "yes"],
    ),
    (
        "from_dataframe no features names argument",
        lambda: fedsub.from_dataframe(frame(), client_column="user"),
        ["features", "numeric", "!data."],
    ),
    ("from_clients huge id", big_id, ["10000000000"]),
    (
        "from_clients table_rows float",
        lambda: fedsub.from_clients(
            [fedsub.samples([0, 1], ids={"item": [1, 2]})] * 2, table_rows={"item": 10.5}
        ),
        ["table_rows", "10.5"],
    ),
    (
        "from_clients field_tables unknown field",
        lambda: fedsub.from_clients(
            [fedsub.samples([0, 1], ids={"item": [1, 2]})] * 2, field_tables={"nope": "item"}
        ),
        ["field_tables", "nope"],
    ),
    (
        "from_clients one-class labels",
        lambda: fedsub.train("sparse-lr", data(labels=lambda k: [1, 1, 1, 1]), **SMALL),
        ["label"],
    ),
    (
        "load_dataset path ignored",
        lambda: fedsub.load_dataset("synthetic-sparse", path="/nonexistent", num_users=10),
        ["path"],
    ),
    ("Config.from_dict None", lambda: fedsub.Config.from_dict(None), ["from_dict"]),
    ("Config.from_dict list", lambda: fedsub.Config.from_dict([1]), ["from_dict"]),
    (
        "run stop_requested=str",
        lambda: fedsub.run(fedsub.Config.from_dict({"train": SMALL}), stop_requested="yes"),
        ["stop_requested"],
    ),
    (
        "run on_round=int",
        lambda: fedsub.run(fedsub.Config.from_dict({"train": SMALL}), on_round=3),
        ["on_round"],
    ),
    (
        "run dict",
        lambda: fedsub.run({"train": {"rounds": 1, "algorithms": ["fedsubavg"]}}),
        None,
    ),
    ("run int", lambda: fedsub.run(3), ["config"]),
    (
        "train algorithms=",
        lambda: fedsub.train("sparse-lr", data(), algorithms=["fedavg"]),
        ["algorithm="],
    ),
    ("train tables=list", lambda: fedsub.train(Bag(), data(), tables=["item"]), ["tables"]),
    ("train tables=str", lambda: fedsub.train(Bag(), data(), tables="item"), ["tables"]),
    ("train rounds=str", lambda: fedsub.train("sparse-lr", data(), rounds="2"), ["rounds"]),
    ("train rounds=1.5", lambda: fedsub.train("sparse-lr", data(), rounds=1.5), ["rounds"]),
    ("train algorithm=1", lambda: fedsub.train("sparse-lr", data(), algorithm=1), ["algorithm"]),
    ("train model=int", lambda: fedsub.train(3, data()), ["model"]),
    ("train data=int", lambda: fedsub.train("sparse-lr", 3), ["data"]),
    (
        "train model_options=list",
        lambda: fedsub.train("sparse-lr", data(), model_options=[1]),
        ["model_options"],
    ),
    (
        "compare algorithms=str",
        lambda: fedsub.compare("sparse-lr", data(), algorithms="fedavg", **SMALL),
        None,
    ),
    (
        "compare algorithms=int",
        lambda: fedsub.compare("sparse-lr", data(), algorithms=3),
        ["algorithms"],
    ),
    (
        "compare algorithm_options list",
        lambda: fedsub.compare("sparse-lr", data(), algorithm_options=[1]),
        ["algorithm_options"],
    ),
    (
        "train option vocabulary",
        lambda: fedsub.train("sparse-lr", data(), lr=-1.0),
        ["lr", "-1.0", "!train."],
    ),
    (
        "load_dataset seed=-1",
        lambda: fedsub.load_dataset("synthetic-sparse", seed=-1),
        ["seed", "-1"],
    ),
    (
        "sweep values=str",
        lambda: fedsub.sweep(None, "train.rounds", "12", out=tempfile.mkdtemp() + "/x"),
        ["values"],
    ),
    ("sweep later value checked first", sweep_later_bad, ["1000000000"]),
    ("run overwrite vocabulary", overwrite_vocabulary, ["overwrite=True", "!--"]),
    ("sweep data.name later unreadable", sweep_later_unreadable, ["movielens"]),
    (
        "module float64 submodule fed float64",
        lambda: fedsub.train(Float64Head(), data(), **SMALL),
        ["float64"],
    ),
    ("module dense never read", dense_unread, ["dense"]),
    (
        "EmbeddingBag include_last_offset given starts",
        lambda: fedsub.train(StartsToLastBag(), data(), **SMALL),
        ["include_last_offset"],
    ),
    ("module 3 columns on 0/1", lambda: fedsub.train(Bag(outputs=3), data(), **SMALL), ["3"]),
    (
        "module float64 submodule",
        lambda: fedsub.train(Bag(dtype=torch.float64), data(), **SMALL),
        None,
    ),
    ("module NaN outputs", lambda: fedsub.train(NaNOut(), data(), **SMALL), ["NaN"]),
    (
        "train loss= accepted",
        lambda: fedsub.train(Bag(), data(), loss=lambda o, y: ((o - y) ** 2).mean(), **SMALL),
        None,
    ),
    ("train task= accepted", lambda: fedsub.train(Bag(), data(), task="binary", **SMALL), None),
    ("EmbeddingBag default offsets", default_bag_trains, None),
    ("Config.from_toml int", lambda: fedsub.Config.from_toml(3), ["source"]),
    (
        "Config.from_toml one override",
        lambda: fedsub.Config.from_toml(None, "train.rounds=2"),
        None,
    ),
    ("from_partitioner int", lambda: fedsub.from_partitioner(3), ["partitioner"]),
    (
        "run on_round=len",
        lambda: fedsub.run(fedsub.Config.from_dict({"train": SMALL}), on_round=len),
        ["on_round"],
    ),
    (
        "train threads=2**31",
        lambda: fedsub.train("sparse-lr", data(), threads=2**31, **SMALL),
        ["threads"],
    ),
    ("samples ragged labels", lambda: fedsub.samples([[0], [1, 2]]), ["labels"]),
]


def classify(call: Callable[[], Any], words: list[str] | None) -> tuple[str, str]:
    try:
        call()
    except FedsubError as error:
        message = str(error)
        if words is None:
            return "unclear", f"refused a valid call: {message}"
        missing = [w for w in words if (w[1:] in message if w[0] == "!" else w not in message)]
        return ("unclear" if missing else "ok"), message
    except Exception as error:
        return "raw", f"{type(error).__name__}: {error}"
    return ("ok", "ran") if words is None else ("silent", "accepted")


def main() -> None:
    verbose = "-v" in sys.argv
    counts: dict[str, int] = {}
    for name, call, words in CASES:
        verdict, message = classify(call, words)
        counts[verdict] = counts.get(verdict, 0) + 1
        if verbose or verdict != "ok":
            print(f"{verdict:8} {name}: {message.splitlines()[0][:220] if message else ''}")
    print({k: counts.get(k, 0) for k in ("ok", "raw", "silent", "unclear")}, len(CASES), "cases")


if __name__ == "__main__":
    main()
