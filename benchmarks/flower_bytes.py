"""Bytes on the wire per round on Flower: FedSubAvg's submodels vs full-model payloads.

Runs the same FedSubAvg training twice in a Flower simulation (Ray backend) on a
MovieLens-like sparse shape (fedsub's embedded synthetic-sparse: one-hot user features and
item crosses, Zipf item popularity), once with ``payload = submodel`` (each node gets its rows
S(k) and replies with their deltas) and once with ``payload = full`` (whole tables both ways,
as stock FedAvg ships them). Counts the ``ArrayRecord`` payload bytes of every Message, and
checks that both payloads train the same model.

    python benchmarks/flower_bytes.py [--users 300] [--rounds 3] [--clients-per-round 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from flwr.simulation import run_simulation
from safetensors.torch import load_file

from fedsub.flower.apps import make_client_app, make_server_app
from fedsub.flower.settings import FlowerSettings, Output


def run(payload: str, overrides: tuple[str, ...], nodes: int, out: Path) -> dict:
    settings = FlowerSettings(overrides=overrides, payload=payload, output=Output(out_dir=str(out)))  # type: ignore[arg-type]
    run_simulation(
        server_app=make_server_app(settings),
        client_app=make_client_app(settings),
        num_supernodes=nodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    return json.loads((out / "flower-result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients-per-round", type=int, default=30)
    args = parser.parse_args()
    overrides = (
        f"data.num_users={args.users}",
        f"train.rounds={args.rounds}",
        f"train.clients_per_round={args.clients_per_round}",
        "train.algorithms=['fedsubavg']",
    )
    with tempfile.TemporaryDirectory() as tmp:
        results, models = {}, {}
        for payload in ("submodel", "full"):
            out = Path(tmp) / payload
            results[payload] = run(payload, overrides, args.users, out)
            models[payload] = load_file(out / "model.safetensors")
    report = {"users": args.users, "clients_per_round": args.clients_per_round}
    for payload, result in results.items():
        rounds = result["rounds"]
        report[f"{payload}_sent_per_round"] = statistics.mean(
            r["train_arrays_bytes_sent"] for r in rounds
        )
        report[f"{payload}_received_per_round"] = statistics.mean(
            r["train_arrays_bytes_received"] for r in rounds
        )
    total = {p: report[f"{p}_sent_per_round"] + report[f"{p}_received_per_round"] for p in results}
    report["full_over_submodel"] = total["full"] / total["submodel"]
    report["max_model_difference"] = max(
        float((models["full"][n] - v).abs().max()) for n, v in models["submodel"].items()
    )
    assert report["max_model_difference"] < 1e-5, "both payloads must train the same model"
    print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main()
