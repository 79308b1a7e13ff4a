"""Three nodes' own small data files and the feature spec they share (tests of node-local
data on Flower): hashed, multi-hot, crossed and vocabulary fields and a numeric column."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedsub.data.feature_spec import FeatureSpec, FieldSpec, NodeFiles, NumericSpec

SPEC = FeatureSpec(
    version=2,
    fields=(
        FieldSpec("item", buckets=64),
        FieldSpec("tags", buckets=16, multi_hot=True),
        FieldSpec("item*country", buckets=32),
        FieldSpec("country", vocabulary=("de", "fr", "it")),
    ),
    numeric=(NumericSpec("price", mean=20.0, std=10.0),),
)
HEADER = "user,label,item,tags,country,price\n"


def rows(rng: np.random.Generator, n: int, user: str) -> str:
    """``n`` samples whose label depends on the item and the country (so a model learns)."""
    lines = []
    for _ in range(n):
        item = int(rng.integers(0, 40))
        country = str(rng.choice(["de", "fr", "it", "es"]))  # "es" is not in the vocabulary
        tags = "|".join(f"t{int(t)}" for t in rng.choice(8, size=int(rng.integers(0, 3))))
        label = int((item % 3 == 0) ^ (country == "fr") ^ (rng.random() < 0.15))
        lines.append(f"{user},{label},i{item},{tags},{country},{rng.uniform(1, 50):.2f}\n")
    return "".join(lines)


@dataclass(frozen=True)
class Federation:
    spec_file: Path
    nodes: list[NodeFiles]
    node_configs: list[str]  # each node's --node-config
    server_test_file: Path


def write_federation(folder: Path) -> Federation:
    """Node 0 and 2 hold out a fraction of their file, node 1 has its own eval file; the
    server has a test file of its own."""
    folder.mkdir(parents=True, exist_ok=True)
    SPEC.write(folder / "spec.json")
    rng = np.random.default_rng(7)
    nodes, configs = [], []
    for k, n in enumerate((30, 24, 36)):
        data = folder / f"node{k}.csv"
        data.write_text(HEADER + rows(rng, n, f"u{k}"))
        eval_file = None
        if k == 1:
            eval_file = folder / "node1-eval.csv"
            eval_file.write_text(HEADER + rows(rng, 10, "u1"))
        node = NodeFiles(data, eval_file, 0.0 if eval_file else 0.3, eval_seed=k)
        nodes.append(node)
        held_out = f'eval-file="{eval_file}"' if eval_file else f"eval-fraction=0.3 eval-seed={k}"
        configs.append(
            f'partition-id={k} data-file="{data}" feature-spec="{folder / "spec.json"}" {held_out}'
        )
    server_test = folder / "server-test.csv"
    server_test.write_text(HEADER + rows(rng, 20, "server"))
    return Federation(folder / "spec.json", nodes, configs, server_test)
