"""peer_speed.py's pfl-research engine, run in pfl's own environment (numpy, torch and pfl
only: no fedsub, whose dp-accounting >= 0.6 pfl 0.6 cannot share; benchmarks/README.md,
"pfl-research's environment").

    .venv-pfl/bin/python benchmarks/peer_pfl.py --inputs INPUTS.npz --out FINAL.npz

``INPUTS.npz`` (peer_speed.py's ``write_pfl_inputs``) holds everything fedsub decides, computed
before any clock: the queue of (round, user) pfl's sampler returns (fedsub's cohorts in order),
each entry's samples in fedsub's order (``entry_offsets`` into ``ids`` / ``labels``), the initial
table and bias, and the schedule (rounds, K, local steps, batch size, learning rate). pfl is set
up as its documentation sets up a simulation (peer_speed.py's docstring says how). Prints one
line of JSON (the steady per-round seconds, ``ru_maxrss``) and writes the final model to
``FINAL.npz``.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np
import torch
import torch.nn.functional as F


class RoundTimes:
    """Wall-clock and CPU stamps at the start and after every round (peer_speed.py's)."""

    def __init__(self) -> None:
        self.wall = [time.perf_counter()]
        self.cpu = [time.process_time()]

    def stamp(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def steady(self) -> dict[str, float]:
        """Median of rounds 2..R on each clock."""
        return {
            "wall": float(np.median(np.diff(self.wall)[1:])),
            "cpu": float(np.median(np.diff(self.cpu)[1:])),
        }


class PflSparseLR(torch.nn.Module):
    """fedsub's sparse LR as the ``torch.nn.Module`` pfl trains: one weight per id (an
    ``EmbeddingBag`` summing a sample's ids) and a bias; ``loss`` and ``metrics`` as pfl
    asks."""

    def __init__(self, table: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weights = torch.nn.EmbeddingBag.from_pretrained(table, freeze=False, mode="sum")
        self.bias = torch.nn.Parameter(bias.clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights(ids).squeeze(-1) + self.bias

    def loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self(ids), labels)

    @torch.no_grad()
    def metrics(self, ids: torch.Tensor, labels: torch.Tensor) -> dict:
        from pfl.metrics import Weighted

        total = F.binary_cross_entropy_with_logits(self(ids), labels, reduction="sum")
        return {"loss": Weighted(float(total), len(labels))}


def pfl_run(inputs: dict[str, np.ndarray]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """FedAvg in pfl's simulation on ``inputs``; the steady per-round times and the model."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.pytorch import PyTorchTensorDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.model.pytorch import PyTorchModel

    rounds, k, steps, batch = (int(inputs[n]) for n in ("rounds", "k", "steps", "batch"))
    lr = float(inputs["lr"])
    ids, labels = torch.from_numpy(inputs["ids"]), torch.from_numpy(inputs["labels"])
    bounds = inputs["entry_offsets"]
    queue = [(int(r), int(u)) for r, u in inputs["queue"]]
    user_data = {
        entry: (ids[bounds[i] : bounds[i + 1]], labels[bounds[i] : bounds[i + 1]])
        for i, entry in enumerate(queue)
    }
    position = iter(queue)

    def user_sampler():  # pfl draws the cohort one user at a time: fedsub's, in order
        return next(position)

    def make_dataset_fn(user):
        return PyTorchTensorDataset(tensors=user_data[user], user_id=str(user[1]))

    federated = FederatedDataset(make_dataset_fn, user_sampler)
    module = PflSparseLR(torch.from_numpy(inputs["table"]), torch.from_numpy(inputs["bias"]))
    model = PyTorchModel(
        model=module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
    )
    clock = RoundTimes()

    class RoundClock(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            clock.stamp()
            return super().on_train_begin(model=model)

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            clock.stamp()
            return False, super().after_central_iteration(
                aggregate_metrics, model, central_iteration=central_iteration
            )[1]

    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds,
            evaluation_frequency=rounds,  # iteration 0 only (each user before / after)
            train_cohort_size=k,
            val_cohort_size=0,
        ),
        backend=SimulatedBackend(training_data=federated, val_data=federated),
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=None,
            local_learning_rate=lr,
            local_batch_size=batch,
            local_num_steps=steps,
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=None),
        callbacks=[RoundClock()],
    )
    clock.wall, clock.cpu = clock.wall[1:], clock.cpu[1:]  # from on_train_begin
    final = {
        "table": module.weights.weight.detach().numpy().reshape(-1).copy(),
        "bias": module.bias.detach().numpy().copy(),
    }
    return clock.steady(), final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with np.load(args.inputs) as handle:
        inputs = {name: handle[name] for name in handle.files}
    seconds, final = pfl_run(inputs)
    np.savez(args.out, **final)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds_per_round": seconds, "ru_maxrss_bytes": peak}))


if __name__ == "__main__":
    main()
