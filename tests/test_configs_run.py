"""Each shipped dataset config runs `fedsub compare` (every algorithm it lists, 2 rounds) and
`fedsub data stats` on small files the test writes in the dataset's real format."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fedsub import config as config_lib
from fedsub.cli import main

from .cifar_files import write_archive
from .test_amazon_din import write_user_files
from .test_images import write_image_set
from .test_movielens import write_1m
from .test_sent140_lstm import tweets, write_csv

CONFIGS = Path(__file__).parents[1] / "configs"


def sent140_csv(folder: Path) -> Path:
    path = folder / "training.1600000.processed.noemoticon.csv"
    write_csv(path, tweets(users=6))
    return path


def amazon_ratings(folder: Path) -> Path:
    """5 users x 45 ratings around the 1385000000 split (the config keeps users with >= 40)."""
    rng = np.random.default_rng(0)
    rows = [
        f"U{u},B{int(rng.integers(30)):04d},{int(rng.integers(1, 6))}.0,{1384000000 + 40000 * k}"
        for u in range(5)
        for k in range(45)
    ]
    path = folder / "ratings_Electronics.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def clicks(folder: Path) -> Path:
    rng = np.random.default_rng(1)
    lines = ["user,clicked,item,country"]
    for _ in range(300):
        user, item = int(rng.integers(20)), int(rng.integers(15))
        lines.append(f"u{user},{int(rng.random() < 0.5)},i{item},c{user % 3}")
    path = folder / "clicks.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


# config file -> (writer of its data.path, extra --set overrides to fit the small files)
CASES: dict[str, tuple[Callable[[Path], Path] | None, list[str]]] = {
    "movielens-lr.toml": (write_1m, []),
    "amazon-din.toml": (lambda f: write_user_files(f / "amazon", users=6, lines=10), []),
    "amazon-electronics-din.toml": (amazon_ratings, []),
    "sent140-lstm.toml": (sent140_csv, []),
    "li-mnist.toml": (
        lambda f: write_image_set(f / "mnist"),
        ["data.num_clients=5", "data.samples_per_client=40"],
    ),
    "fmnist-masking.toml": (
        lambda f: write_image_set(f / "fmnist"),
        ["data.num_clients=5", "train.local_steps=2"],
    ),
    "li-synthetic.toml": (None, ["data.num_devices=6"]),
    # ResNet-18 (a quarter of its widths, to keep this fast) on 32 x 32 colour images
    "seed003-cifar10-resnet18.toml": (
        lambda f: write_archive(f / "cifar-10-python.tar.gz", "cifar10", per_batch=20),
        ["data.num_clients=5", "model.widths=[16,32,64,128]", "train.local_steps=1"],
    ),
    "seed003-cifar100-resnet18.toml": (
        lambda f: write_archive(f / "cifar-100-python.tar.gz", "cifar100", per_batch=100),
        ["data.num_clients=5", "model.widths=[16,32,64,128]", "train.local_steps=1"],
    ),
    "li-quadratic.toml": (None, []),
    "table.toml": (clicks, []),
    "table2-synthetic.toml": (None, ["data.num_users=60"]),
}


def test_every_shipped_config_has_a_case():
    assert sorted(CASES) == sorted(p.name for p in CONFIGS.glob("*.toml"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_runs_compare_and_stats(name, tmp_path, capsys):
    writer, extra = CASES[name]
    sets = [*extra, "train.rounds=2", "train.clients_per_round=2", "eval.every=1"]
    if writer is not None:
        sets.append(f"data.path={writer(tmp_path)}")
    args = [a for s in sets for a in ("--set", s)]
    out = tmp_path / "out"
    assert main(["compare", str(CONFIGS / name), *args, "--out", str(out), "--quiet"]) == 0
    config = config_lib.load(CONFIGS / name)
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary["algorithms"]) == sorted(config.train.algorithms)
    for record in summary["algorithms"].values():
        assert math.isfinite(record["final"]["train_loss"])

    data_sets = [a for s in sets if s.startswith("data.") for a in ("--set", s)]
    capsys.readouterr()
    assert main(["data", "stats", str(CONFIGS / name), *data_sets]) == 0
    table = capsys.readouterr().out
    assert config.data.name in table and "clients" in table and "samples" in table
