"""Masking schemes compared on time to accuracy under heterogeneous capacities (issue 51).

Seed 003's masking (static, rolling, random, Bernoulli; and no masking) with
``masking.capacity_assignment = "memory"``: the capacity levels [1, 1/2, 1/4, 1/8, 1/16] dealt
in equal shares by the clients' memory in their device profiles, the clock synchronous with
[clock]'s lognormal device profiles (drawn from train.seed, the same devices for every
scheme). A member of capacity beta does beta^2 of the full model's work and bytes under channel
slices and beta under Bernoulli masks (clock/synchronous.py), so a round waits for its slowest
member's share.

NOT the paper's dataset: seed 003 (and configs/fmnist-masking.toml, its small stand-in) trains on
CIFAR / Fashion-MNIST, which cannot be downloaded on the benchmark machine. The closest workload
that runs here: the UCI handwritten digits that scikit-learn ships inside its package (1,797
8x8 images, 10 classes; ``sklearn.datasets.load_digits``, no download) written as MNIST IDX
files, then fmnist-masking.toml's protocol (2 labels per client, 10 clients per round, SGD
with momentum, weight decay and clipping, capacities [1, 1/2, 1/4, 1/8, 1/16] dealt by memory)
with a width-sliceable MLP (two hidden layers of 128) for its CNN (8x8 is below the CNN's
16x16; and the MLP keeps the run within the 2 shared cores), 50 clients (the data are ~1/40
of Fashion-MNIST's), 10 local steps of 20, and the first 1,500 images for training, the other
297 for test. Virtual
seconds are simulated: exact functions of the seed; the accuracies are this small data's.

    .venv/bin/python benchmarks/masking_time.py [--rounds 40] [--seeds 0] [--target 0.6]

Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import struct
import tempfile
from pathlib import Path

import numpy as np

import fedsub
from fedsub.runs.experiment import compare

ROOT = Path(__file__).resolve().parents[1]
TRAIN = 1500  # the first images train, the rest test

SCHEMES = ("none", "static", "rolling", "random", "bernoulli")
WORKLOAD = [
    "data.name=mnist",
    "data.num_clients=50",
    "model.name=mlp",
    "model.widths=[128,128]",
    "train.local_steps=10",
    "clock.mode=synchronous",
    "eval.every=5",
]


def idx_bytes(array: np.ndarray) -> bytes:
    """``array`` (uint8) as an IDX file."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.tobytes()


def write_digits(folder: Path) -> Path:
    """scikit-learn's digits as MNIST IDX files in ``folder`` (8x8 pixels of 0..16 scaled to
    0..255)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.clip(digits.images * 16, 0, 255).astype(np.uint8)
    labels = digits.target.astype(np.uint8)
    arrays = {
        "train-images-idx3-ubyte": images[:TRAIN],
        "train-labels-idx1-ubyte": labels[:TRAIN],
        "t10k-images-idx3-ubyte": images[TRAIN:],
        "t10k-labels-idx1-ubyte": labels[TRAIN:],
    }
    for name, array in arrays.items():
        (folder / name).write_bytes(idx_bytes(np.ascontiguousarray(array)))
    return folder


def curve(scheme: str, seed: int, rounds: int, data: Path) -> list[tuple[int, float, float]]:
    """(round, virtual seconds, test accuracy) at every evaluation of one run."""
    sets = [*WORKLOAD, f"data.path={data}", f"train.seed={seed}", f"train.rounds={rounds}"]
    sets.append(f"masking.scheme={scheme}")
    if scheme != "none":  # capacities from the profiles' memory (inert without masking)
        sets.append("masking.capacity_assignment=memory")
    config = fedsub.Config.from_toml(ROOT / "configs" / "fmnist-masking.toml", sets)
    outcome = compare(config, None)
    return [
        (e.round, float(e.metrics["virtual_time"]), float(e.metrics["test_accuracy"]))
        for e in outcome.histories["fedavg"]
    ]


def to_target(points: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """The first evaluation reaching ``target`` test accuracy: (round, virtual seconds)."""
    for r, t, accuracy in points:
        if accuracy >= target:
            return r, t
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--target", type=float, default=0.6, help="test accuracy")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    args = parser.parse_args()
    results: dict[str, dict] = {}
    data = write_digits(Path(tempfile.mkdtemp(prefix="digits-")))
    for scheme in args.schemes:
        runs = []
        for seed in args.seeds:
            points = curve(scheme, seed, args.rounds, data)
            reached = to_target(points, args.target)
            runs.append(
                {
                    "seed": seed,
                    "rounds_to_target": reached[0] if reached else None,
                    "time_to_target": round(reached[1], 1) if reached else None,
                    "final_test_accuracy": round(points[-1][2], 4),
                    "virtual_seconds_per_round": round(points[-1][1] / points[-1][0], 2),
                    "curve": [(r, round(t, 1), round(a, 4)) for r, t, a in points],
                }
            )
        results[scheme] = {"runs": runs}
        print(scheme, json.dumps(runs), flush=True)
    results["settings"] = {"rounds": args.rounds, "seeds": args.seeds, "target": args.target}
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
