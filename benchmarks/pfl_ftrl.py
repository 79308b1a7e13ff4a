"""Issue 50's peer: the embedded default's FedAvg trained with pfl-research's DP-FTRL (its
``BandedMatrixFactorizationMechanism``, dense: noise on every parameter) at the epsilon and
participation pattern fedsub's DP-FTRL runs are given (benchmarks/dp_ftrl.py), its final test
AUC scored by fedsub.

    python benchmarks/pfl_ftrl.py [--epsilons 0,1,2,4,8] [--clients-per-round 50]
        [--separation 50] [--rounds 150] [--clip 0.5] [--set data.num_users=30000]
        [--pfl-python .venv-pfl/bin/python] [--fedsub-runs 2] [--skip-pfl]

This process (fedsub's environment) loads the dataset fedsub's config names (the embedded
default, ``--set`` overrides as in dp_ftrl.py), draws the cohorts under the participation bound
DP-FTRL is accounted for (fedsub's ``ParticipationBound``: K users a round, uniformly among
those not in the last b - 1 rounds' cohorts, the rule fedsub's cohort draw enforces; the draw
is from ``--seed``, no secret, since neither epsilon relies on it), writes them with every
user's samples and fedsub's initial model to a file, and runs pfl_ftrl_engine.py in pfl's own
environment (pfl 0.6 needs dp-accounting < 0.6; benchmarks/README.md says how to make it). pfl
trains FedAvg there (10 local SGD steps of 5 samples at learning rate 0.1, central SGD at 1,
each user's model difference clipped to ``--clip`` in L2, weight 1 a user, the noisy sum
averaged over K: fedsub's DP-FedAvg with a fixed denominator K) with pfl's DP-FTRL calibrated
by pfl's ``RDPPrivacyAccountant`` to the same (epsilon, delta), delta = 1 / N^1.1 as fedsub's
default. The final model comes back and fedsub's ``roc_auc`` scores it on the test set.

The privacy check: pfl accounts ceil(T / b) compositions of a Gaussian of multiplier z_pfl,
which assumes the factorization's columns have norm <= 1 and are orthogonal for rounds b apart.
The engine reports the factorization's column norms and the exact sensitivity of the pattern
under it (a dynamic program over the rounds), and this script asks fedsub's DP-FTRL accounting
(``ftrl_accounting.gaussian_epsilon``, dp-accounting's RDP) for the epsilon of the whole run
as one Gaussian mechanism of multiplier z_pfl / sensitivity: the two epsilons should agree.
pfl 0.6's factorization is not normalised that way (its strategy is ``cholesky(X)``, whose
rows, not columns, have norm 1), so its reported epsilon understates the run's;
``--exact-sensitivity`` scales pfl's noise multiplier by sensitivity / sqrt(k), after which
the run is the mechanism pfl's accountant charges (fedsub's correction, not pfl's).
``--epsilons`` 0 is a run without DP (pfl's FedAvg against fedsub's: the pipelines' check).

fedsub's row (``--fedsub-runs`` runs a cell, 2 by default; 0: none): the same config's
FedSubAvg with fedsub's sparse DP-FTRL at the same epsilon and delta, its settings from
fedsub's rule for the capped form (``dp/selection.py`` ``capped_rule``: the noise, the window and
its refresh, the selection's share, the heat cap and at most 1% of the table's rows a round, from
epsilon, K, the rounds, b and the table only; chosen on another workload by benchmarks/
ftrl_rule_grid.py), its cohorts drawn by fedsub under ``dp.min_separation`` = b with secret
randomness; the final test AUC of each run and their mean, and the rows noised a round.
``--skip-pfl`` runs fedsub's row only.

Ends with ``RESULT {json}``: per epsilon, ``pfl`` (pfl's run) and ``fedsub`` (fedsub's row).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dp_ftrl import recording, run  # benchmarks/dp_ftrl.py: one fedsub run and its DP stats
from fedsub.config import Config
from fedsub.dp import ftrl_accounting, selection
from fedsub.dp.participation import ParticipationBound, Pattern
from fedsub.dp.settings import default_delta
from fedsub.engine.initial import initial_params
from fedsub.engine.metrics import roc_auc
from fedsub.runs.run_setup import load_data, model_of, schedule_of

PFL_VENV = Path(__file__).resolve().parents[1] / ".venv-pfl"  # pfl-research's environment


def fixed_width(ragged) -> np.ndarray:
    """A ragged id column of equal rows as (samples, width) (sparse LR's ids)."""
    lengths = np.diff(ragged.offsets)
    if len(lengths) and (lengths != lengths[0]).any():
        raise SystemExit("pfl_ftrl.py: the dataset's samples have different numbers of ids")
    return ragged.values.reshape(len(lengths), -1)


def cohorts(num_users: int, rounds: int, k: int, separation: int, seed: int) -> np.ndarray:
    """(round, user) for every member of every round's cohort, drawn as fedsub's cohort draw
    under ``dp.min_separation`` draws (uniformly among the eligible)."""
    bound = ParticipationBound(Pattern(min_separation=separation), num_users)
    generator = np.random.default_rng(seed)
    queue = []
    for r in range(1, rounds + 1):
        eligible = bound.eligible(r, None)
        if len(eligible) < k:
            raise SystemExit(f"pfl_ftrl.py: round {r} has {len(eligible)} eligible users < K {k}")
        cohort = np.sort(generator.choice(eligible, size=k, replace=False))
        bound.record(r, cohort)
        queue += [(r, int(u)) for u in cohort]
    return np.asarray(queue, dtype=np.int64)


def write_inputs(config: Config, dataset, args: argparse.Namespace, epsilon: float, path: Path):
    """Everything pfl's engine trains on, as fedsub decides it (module docstring)."""
    model = model_of(config, dataset)
    start = initial_params(model, schedule_of(config))
    (table,) = start.tables.values()
    (bias,) = start.dense.values()
    (column,) = dataset.train.ids.values()
    np.savez(
        path,
        ids=fixed_width(column).astype(np.int64),
        labels=dataset.train.labels.astype(np.float32),
        user_offsets=np.asarray(dataset.client_offsets, dtype=np.int64),
        queue=cohorts(dataset.num_clients, args.rounds, args.clients_per_round,
                      args.separation, args.seed),
        table=table.numpy().astype(np.float32), bias=bias.numpy().astype(np.float32),
        rounds=args.rounds, k=args.clients_per_round, steps=config.train.local_steps,
        batch=config.train.batch_size, lr=config.train.client_step.lr, seed=args.seed,
        clip=args.clip, epsilon=epsilon, delta=default_delta(dataset.num_clients),
        min_separation=args.separation, exact_sensitivity=int(args.exact_sensitivity),
    )  # fmt: skip


def test_auc(dataset, final: dict[str, np.ndarray]) -> float:
    """fedsub's ``roc_auc`` of sparse LR's logits (sum of the ids' weights + bias)."""
    (column,) = dataset.test.ids.values()
    logits = final["table"][fixed_width(column)].sum(axis=1) + final["bias"].reshape(-1)[0]
    return roc_auc(dataset.test.labels, logits.astype(np.float64))


def pfl_python(given: str | None) -> str:
    found = given or str(PFL_VENV / "bin" / "python")
    if not Path(found).exists():
        sys.exit(
            f"pfl_ftrl.py: no Python of pfl-research's environment at {found}; make it as "
            "benchmarks/README.md says (pfl-research's environment) or give --pfl-python PATH"
        )
    return found


def one(config: Config, dataset, args: argparse.Namespace, epsilon: float, folder: str) -> dict:
    inputs, out = Path(folder) / f"inputs-{epsilon}.npz", Path(folder) / f"final-{epsilon}.npz"
    write_inputs(config, dataset, args, epsilon, inputs)
    engine = Path(__file__).parent / "pfl_ftrl_engine.py"
    started = time.perf_counter()
    done = subprocess.run(
        [pfl_python(args.pfl_python), str(engine), "--inputs", str(inputs), "--out", str(out)],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_seconds"] = time.perf_counter() - started
    with np.load(out) as final:
        result["final_test_auc"] = test_auc(dataset, {n: final[n] for n in final.files})
    if result["dp"]:
        delta = default_delta(dataset.num_clients)
        used = result.get("noise_multiplier_used", result["pfl_noise_multiplier"])
        effective = used / result["sensitivity"]
        result["delta"] = delta
        result["fedsub_epsilon"] = ftrl_accounting.gaussian_epsilon(effective, delta, "rdp")
        result["epsilon_ratio"] = result["fedsub_epsilon"] / result["pfl_epsilon"]
    return result


def rule_overrides(config: Config, dataset, args: argparse.Namespace, epsilon: float) -> list[str]:
    """fedsub's capped sparse DP-FTRL at ``epsilon`` as config overrides (``capped_rule``)."""
    model = model_of(config, dataset)
    (table,) = initial_params(model, schedule_of(config)).tables.values()
    rule = selection.capped_rule(
        epsilon, args.clients_per_round, args.rounds, args.separation, int(table.shape[0])
    )
    return [
        *rule.overrides(args.separation),
        f"dp.target_epsilon={epsilon}",
        f"dp.clip={args.clip}",
    ]


def fedsub_row(config: Config, dataset, args: argparse.Namespace, epsilon: float) -> dict:
    """fedsub's sparse DP-FTRL-FedSubAvg at ``epsilon``, ``--fedsub-runs`` times."""
    base = [
        f"train.rounds={args.rounds}",
        f"train.clients_per_round={args.clients_per_round}",
        "execution.threads=1",
        f"eval.every={args.rounds}",
        *args.set,
    ]
    dp = rule_overrides(config, dataset, args, epsilon)
    runs = [run([*base, *dp], "fedsubavg") for _ in range(args.fedsub_runs)]
    aucs = [r["final_test_auc"] for r in runs]
    return {
        "overrides": dp,
        "final_test_auc": aucs,
        "mean_final_test_auc": float(np.mean(aucs)),
        "epsilon": [r["epsilon"] for r in runs],
        "rows_noised_per_round": [r["rows_noised_per_round"] for r in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--epsilons",
        type=lambda t: [float(x) for x in t.split(",")],
        default=[0.0, 1.0, 2.0, 4.0, 8.0],
        help="0: without DP",
    )
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--clients-per-round", type=int, default=50)
    parser.add_argument("--separation", type=int, default=50)
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0, help="the cohort draw and the shuffles")
    parser.add_argument("--set", action="append", default=[], help="a config override")
    parser.add_argument("--pfl-python", default=None)
    parser.add_argument(
        "--exact-sensitivity",
        action="store_true",
        help="scale pfl's noise by its factorization's true sensitivity over sqrt(k) (fedsub's "
        "correction: the epsilon pfl reports then holds)",
    )
    parser.add_argument("--fedsub-runs", type=int, default=2, help="fedsub's row: runs a cell")
    parser.add_argument("--skip-pfl", action="store_true", help="fedsub's row only")
    args = parser.parse_args()
    config = Config.from_toml(
        None,
        [
            f"train.rounds={args.rounds}",
            f"train.clients_per_round={args.clients_per_round}",
            "train.algorithms=['fedavg']",
            *args.set,
        ],
    )
    dataset = load_data(config)
    results: dict = {"settings": vars(args)}
    if args.fedsub_runs:
        recording()  # the rows noised a round, for fedsub's row
    with tempfile.TemporaryDirectory() as folder:
        for epsilon in args.epsilons:
            cell: dict = {}
            if not args.skip_pfl:
                cell["pfl"] = one(config, dataset, args, epsilon, folder)
            if args.fedsub_runs and epsilon > 0:
                cell["fedsub"] = fedsub_row(config, dataset, args, epsilon)
            results[f"epsilon={epsilon:g}"] = cell
            print(f"eps {epsilon:g}", cell, flush=True)
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
