"""benchmarks/workloads.py's Sent140 shape has the statistics its docstring and
benchmarks/README.md state (seed 001's Table 1 and the loader's cuts)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from workloads import sent140_like


def test_sent140_like_has_the_papers_users_tweets_and_the_loaders_cuts():
    dataset = sent140_like()
    assert dataset.num_clients == 1_473
    tweets = len(dataset.train) + len(dataset.test)
    assert abs(tweets - 79_050) / 79_050 < 0.02  # the paper's count, ~54 per user
    assert abs(len(dataset.test) / tweets - 0.2) < 0.01  # the 80/20 split
    lengths = dataset.train.ids["words"].lengths()
    assert lengths.min() >= 1 and lengths.max() == 25  # max_tokens
    assert 13.5 < lengths.mean() < 15.0
    words = dataset.train.ids["words"].values
    assert dataset.table_rows["words"] == 10_001 and words.max() < 10_001
    assert 0.1 < (words == 0).mean() < 0.2  # out of vocabulary
    assert abs(dataset.train.labels.mean() - 0.5) < 0.02
    assert np.array_equal(sent140_like().train.ids["words"].values, words)  # seeded


ROOT = Path(__file__).parents[1]


def pins(path: Path) -> dict[str, str]:
    """``name==version`` lines of a constraints file."""
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return dict(line.split("==") for line in lines if "==" in line)


def test_pfl_research_gets_an_environment_of_its_own():
    """pfl 0.6 needs dp-accounting < 0.6, fedsub >= 0.6: no extra of fedsub's pulls pfl (the
    `bench` extra installs again), its environment pins constraints.txt's torch and not its
    dp-accounting, and its engine (peer_pfl.py) imports no fedsub."""
    import ast
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert not [r for rs in extras.values() for r in rs if r.startswith("pfl")], extras
    ours, theirs = pins(ROOT / "constraints.txt"), pins(ROOT / "benchmarks/pfl-constraints.txt")
    assert theirs == {"torch": ours["torch"]}
    assert "pfl[pytorch]" in (ROOT / "benchmarks/pfl-requirements.txt").read_text()
    tree = ast.parse((ROOT / "benchmarks/peer_pfl.py").read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= {"__future__", "argparse", "json", "resource", "time", "numpy", "torch",
                        "pfl"}, imported  # fmt: skip
