"""pfl_ftrl.py's pfl-research side, run in pfl's own environment (numpy, torch and pfl only:
no fedsub, whose dp-accounting >= 0.6 pfl 0.6 cannot share; benchmarks/README.md,
"pfl-research's environment").

    .venv-pfl/bin/python benchmarks/pfl_ftrl_engine.py --inputs INPUTS.npz --out FINAL.npz

``INPUTS.npz`` (pfl_ftrl.py's ``write_inputs``) holds the embedded default's users (each
user's samples: ``user_offsets`` into ``ids`` / ``labels``), the queue of (round, user) of
the cohorts pfl_ftrl.py drew under the participation bound, the initial table and bias, the
schedule (rounds, K, local steps, batch size, learning rate), and the privacy (clip, epsilon,
delta, min_separation; epsilon 0: no DP). pfl trains FedAvg as its documentation sets up a
simulation (peer_pfl.py's setup: ``FederatedDataset``, ``PyTorchModel`` with local
``torch.optim.SGD`` and central SGD at learning rate 1, ``FederatedAveraging``), with pfl's
DP-FTRL: ``BandedMatrixFactorizationMechanism(clip, rounds, min_separation,
make_privacy_accountant)`` (pfl/privacy/ftrl_mechanism.py: the banded matrix factorization of
Choquette-Choo et al. 2023, its noise multiplier from ``RDPPrivacyAccountant`` over the
ceil(T / b) participations with sampling probability 1) wrapped in
``CentrallyAppliedPrivacyMechanism`` as the backend's postprocessor (each user's model
difference clipped to L2 norm ``clip``, the noise added to the cohort's sum, then averaged
over the K users). A user's samples are shuffled afresh each time it takes part.

Prints one line of JSON (pfl's noise multiplier and epsilon, the participations k, the
factorization's column norms and the exact sensitivity of the pattern under it, the parameters
noised per round) and writes the final model to ``FINAL.npz``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from peer_pfl import PflSparseLR


def separated_sensitivity(gram: np.ndarray, separation: int) -> float:
    """sqrt(max over participations P, any two >= ``separation`` apart, of sum_{p, q in P}
    gram[p, q]) when the cross terms vanish (gram banded narrower than ``separation``, which
    this checks): a dynamic program over the rounds, best[t] = max(best[t - 1],
    best[t - b] + gram[t, t])."""
    n = len(gram)
    band = np.abs(np.subtract.outer(np.arange(n), np.arange(n))) >= separation
    if np.abs(gram[band]).max(initial=0.0) > 1e-9 * np.abs(gram).max():
        raise ValueError("the factorization's Gram matrix is not banded below min_separation")
    best = np.zeros(n + 1)
    for t in range(1, n + 1):
        best[t] = max(best[t - 1], best[max(t - separation, 0)] + gram[t - 1, t - 1])
    return float(np.sqrt(best[n]))


def mechanism(inputs: dict[str, np.ndarray]) -> tuple[object | None, dict]:
    """pfl's DP-FTRL for the inputs' privacy, and what it reports (None: no DP)."""
    from pfl.privacy import CentrallyAppliedPrivacyMechanism, RDPPrivacyAccountant
    from pfl.privacy.ftrl_mechanism import BandedMatrixFactorizationMechanism

    epsilon = float(inputs["epsilon"])
    if epsilon <= 0:
        return None, {"dp": False}
    rounds, separation = int(inputs["rounds"]), int(inputs["min_separation"])
    accountants = []

    def make_privacy_accountant(num_compositions: int) -> RDPPrivacyAccountant:
        accountant = RDPPrivacyAccountant(
            num_compositions=num_compositions,
            sampling_probability=1.0,
            mechanism="gaussian",
            epsilon=epsilon,
            delta=float(inputs["delta"]),
        )
        accountants.append(accountant)
        return accountant

    banded = BandedMatrixFactorizationMechanism(
        float(inputs["clip"]), rounds, separation, make_privacy_accountant
    )
    (accountant,) = accountants
    c = np.asarray(banded.query_matrix, dtype=np.float64)
    gram = c.T @ c
    report = {
        "dp": True,
        "pfl_noise_multiplier": float(accountant.cohort_noise_parameter),
        "pfl_epsilon": float(accountant.epsilon),
        "pfl_delta": float(accountant.delta),
        "participations": int(accountant.num_compositions),
        "column_norm_max": float(np.sqrt(np.diag(gram).max())),
        "column_norm_min": float(np.sqrt(np.diag(gram).min())),
        "sensitivity": separated_sensitivity(gram, separation),
    }
    if int(inputs.get("exact_sensitivity", 0)):
        # fedsub's correction (pfl_ftrl.py --exact-sensitivity): the node noise scaled by the
        # factorization's true sensitivity over the sqrt(k) pfl's accountant assumes, so that
        # the run is the Gaussian mechanism pfl's accountant charges
        scale = report["sensitivity"] / np.sqrt(report["participations"])
        banded._relative_noise_stddev = report["pfl_noise_multiplier"] * scale
        report["noise_multiplier_used"] = report["pfl_noise_multiplier"] * scale
    return CentrallyAppliedPrivacyMechanism(banded), report


def pfl_run(inputs: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """FedAvg with pfl's DP-FTRL in pfl's simulation on ``inputs``; its report and the model."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.pytorch import PyTorchTensorDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.model.pytorch import PyTorchModel

    rounds, k, steps, batch = (int(inputs[n]) for n in ("rounds", "k", "steps", "batch"))
    ids, labels = torch.from_numpy(inputs["ids"]), torch.from_numpy(inputs["labels"])
    bounds = inputs["user_offsets"]
    queue = iter([(int(r), int(u)) for r, u in inputs["queue"]])
    shuffle = np.random.default_rng(int(inputs["seed"]))

    def make_dataset_fn(entry):
        user = entry[1]
        size = bounds[user + 1] - bounds[user]
        order = torch.from_numpy(bounds[user] + shuffle.permutation(size))
        return PyTorchTensorDataset(tensors=(ids[order], labels[order]), user_id=str(user))

    federated = FederatedDataset(make_dataset_fn, lambda: next(queue))
    module = PflSparseLR(torch.from_numpy(inputs["table"]), torch.from_numpy(inputs["bias"]))
    model = PyTorchModel(
        model=module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
    )
    private, report = mechanism(inputs)
    backend = SimulatedBackend(
        training_data=federated,
        val_data=federated,
        postprocessors=[private] if private is not None else [],
    )
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds,
            evaluation_frequency=rounds + 1,  # no evaluation: fedsub evaluates the final model
            train_cohort_size=k,
            val_cohort_size=0,
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=None,
            local_learning_rate=float(inputs["lr"]),
            local_batch_size=batch,
            local_num_steps=steps,
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=None),
    )
    report["parameters_noised_per_round"] = (
        sum(p.numel() for p in module.parameters()) if private is not None else 0
    )
    final = {
        "table": module.weights.weight.detach().numpy().reshape(-1).copy(),
        "bias": module.bias.detach().numpy().copy(),
    }
    return report, final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with np.load(args.inputs) as handle:
        inputs = {name: handle[name] for name in handle.files}
    out = os.path.abspath(args.out)
    with tempfile.TemporaryDirectory() as folder:  # pfl writes its factorization to the cwd
        os.chdir(folder)
        report, final = pfl_run(inputs)
    np.savez(out, **final)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
