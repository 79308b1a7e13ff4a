"""FedAvg vs FedSubAvg on a two-tower recommender written as a plain nn.Module.

    python examples/two-tower/train.py [--rounds 300] [--out runs/two-tower]

writes curves.png (train loss and test AUC per round), histories.json and the trained module
(FedSubAvg's) as two_tower.pt.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from two_tower import TwoTower, clicks

import fedsub

SCHEDULE = {
    "clients_per_round": 20,
    "local_steps": 5,
    "batch_size": 8,
    "lr": 0.3,
    "every": 10,
    "threads": 1,
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--users", type=int, default=500, help="clients")
    parser.add_argument("--out", type=Path, default=Path("runs/two-tower"))
    args = parser.parse_args(argv)

    data = clicks(users=args.users, items=4 * args.users)
    rows = data.table_rows
    torch.manual_seed(0)
    model = TwoTower(rows["user"], rows["age"], rows["item"], rows["category"])
    runs = fedsub.compare(
        model, data, algorithms=["fedavg", "fedsubavg"], rounds=args.rounds, **SCHEDULE
    )

    args.out.mkdir(parents=True, exist_ok=True)
    figure, (loss, auc) = plt.subplots(1, 2, figsize=(10, 4))
    for name, run in runs.items():
        rounds = [e["round"] for e in run.history]
        loss.plot(rounds, [e["train_loss"] for e in run.history], label=name)
        auc.plot(rounds, [e["test_auc"] for e in run.history], label=name)
        last = run.history[-1]
        print(f"{name}: train loss {last['train_loss']:.4f}, test AUC {last['test_auc']:.4f}")
    loss.set(xlabel="round", ylabel="train loss", title="two-tower on generated clicks")
    auc.set(xlabel="round", ylabel="test AUC")
    loss.legend()
    figure.tight_layout()
    figure.savefig(args.out / "curves.png", dpi=120)
    histories = {name: run.history for name, run in runs.items()}
    (args.out / "histories.json").write_text(json.dumps(histories, indent=1))
    torch.save(runs["fedsubavg"].model.state_dict(), args.out / "two_tower.pt")
    return runs


if __name__ == "__main__":
    main()
