"""The two experiments the papers solve in closed form, run through fedsub's round loop and
plotted beside the formula.

- Seed 001's Example 1 (section 3.1, Figure 2): w1 involves client 1 only, w2 all N clients,
  ``f_1 = w1^2 + w2^2``, ``f_i = w2^2``; one exact local step. FedAvg moves w1 by
  ``(1 - 2 eta / N)`` per round, FedSubAvg by ``(1 - 2 gamma)``.
- Seed 004's Theorem 4 (appendix C): ``li-quadratic`` with ``linear-regression``; FedAvg with
  a constant lr stops at eq. (28), away from the optimum unless E = 1; with a decaying lr it
  gets closer to the optimum than any constant-lr limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.data import li_quadratic
from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.loop import Evaluation
from fedsub.engine.schedule import ClientStep, LocalWork, LrSchedule, Schedule, lr_at
from fedsub.models.base import Features, Ids, Model, Task
from fedsub.models.linear_regression import LinearRegression
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params

Row = tuple[str, float | None, float | None]  # (cell, the paper's closed form, fedsub)


@dataclass(frozen=True)
class ClosedFormResult:
    rows: list[Row]  # what the verdict compares
    verdict: str
    plot: Path


# --- seed 001, Example 1 --------------------------------------------------------------------


@dataclass(frozen=True)
class SquaredDistance:
    """Per sample: ``sum over its ids m of (w_m - xi)^2``, xi the label; a scalar per row.
    Example 1's local objectives, with each parameter a row of one table ``w``."""

    rows: int
    w0: float
    task: Task = "regression"

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        return Params({"w": torch.full((self.rows, 1), self.w0, dtype=dtype)}, {})

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features:
        values, offsets = ids["w"]
        w = tables["w"]

        def bag(weight: torch.Tensor) -> torch.Tensor:
            return F.embedding_bag(values, weight, offsets, mode="sum", include_last_offset=True)[
                :, 0
            ]

        return {"moments": torch.stack([bag(w**2), bag(w), bag(torch.ones_like(w))], dim=1)}

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        return features["moments"]

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        squares, sums, count = outputs.unbind(1)
        return (squares - 2 * labels * sums + labels**2 * count).mean()


def example1_dataset(clients: int) -> FederatedDataset:
    """Client 1 involves w1 (row 0) and w2 (row 1), the others only w2; every xi = 0."""
    ids = [[[0, 1]]] + [[[1]] for _ in range(clients - 1)]
    parts = [SampleSet({"w": Ragged.from_lists(c)}, np.zeros(1)) for c in ids]
    return FederatedDataset.from_clients("example-1", {"w": 2}, parts, parts[0])


def _history(
    model: Model,
    name: str,
    dataset: FederatedDataset,
    schedule: Schedule,
    extra: Callable[[Params], dict[str, float]],
    heat: str = "clients",
) -> list[Evaluation]:
    index = SubmodelIndex.build(dataset)
    algorithm = build_algorithm(name, AlgorithmContext(dataset, index, heat))  # type: ignore[arg-type]  # a HeatKind literal
    evaluator = Evaluator.build(model, dataset, len(dataset.train), 0, extra)
    history: list[Evaluation] = []
    train(model, algorithm, dataset, index, schedule, evaluator, on_evaluation=history.append)
    return history


def example_1(out: Path, smoke: bool) -> ClosedFormResult:
    """N = 100 (heat dispersion 100), w0 = (1, 1), eta = gamma = 0.1 (the figure's rates are
    not given), one exact local step, every client every round."""
    clients, lr, rounds = (10, 0.1, 5) if smoke else (100, 0.1, 100)
    dataset = example1_dataset(clients)
    schedule = Schedule(
        rounds,
        clients,
        local=LocalWork(1, 1, ClientStep(lr=lr)),
        seed=0,
        execution=Execution(dtype=torch.float64),
    )
    model = SquaredDistance(rows=2, w0=1.0)

    def coordinates(params: Params) -> dict[str, float]:
        w = params.tables["w"][:, 0].tolist()
        return {"w1": w[0], "w2": w[1]}

    runs = {n: _history(model, n, dataset, schedule, coordinates) for n in ("fedavg", "fedsubavg")}
    rate = {"fedavg": (1 - 2 * lr / clients, 1 - 2 * lr), "fedsubavg": (1 - 2 * lr, 1 - 2 * lr)}
    rows: list[Row] = []
    worst = 0.0
    for name, history in runs.items():
        for e in history:
            for k, coordinate in enumerate(("w1", "w2")):
                worst = max(worst, abs(e.metrics[coordinate] - rate[name][k] ** e.round))
        last = history[-1]
        rows += [
            (
                f"{name} w1 after {last.round} rounds",
                rate[name][0] ** last.round,
                last.metrics["w1"],
            ),
            (
                f"{name} w2 after {last.round} rounds",
                rate[name][1] ** last.round,
                last.metrics["w2"],
            ),
        ]
    plot = out / "example1.png"
    _plot_example(runs, rate, clients, lr, plot)
    return ClosedFormResult(rows, example_verdict(worst, clients), plot)


# Example 1's runs are the closed forms up to floating-point rounding; Theorem 4's end within
# this fraction of eq. (28)'s distance (the runs stop at a finite round).
EXAMPLE_TOLERANCE = 1e-9
THEOREM_TOLERANCE = 0.05


def example_verdict(worst: float, clients: int) -> str:
    """'within' only up to rounding: a larger gap from the closed forms "differs"."""
    if worst <= EXAMPLE_TOLERANCE:
        return f"within {worst:.1e} of the closed forms at every round (N = {clients})"
    return f"differs: {worst:.1e} from the closed forms (N = {clients}), beyond rounding"


def _plot_example(runs, rate, clients: int, lr: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (plane, w1) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, history in runs.items():
        plane.plot(
            [e.metrics["w1"] for e in history],
            [e.metrics["w2"] for e in history],
            "o-",
            ms=2,
            label=f"{name} (fedsub)",
        )
        rounds = np.array([e.round for e in history])
        w1.semilogy(rounds, [max(e.metrics["w1"], 1e-300) for e in history], label=f"{name} w1")
        w1.semilogy(rounds, rate[name][0] ** rounds, "k:", lw=1)
    plane.set_xlabel("w1")
    plane.set_ylabel("w2")
    plane.set_title(f"Example 1: trajectories, N = {clients}, lr {lr:g}")
    w1.set_xlabel("round")
    w1.set_ylabel("w1 (dotted: closed form)")
    w1.set_title("w1 against the closed forms")
    for ax in (plane, w1):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- seed 004, Theorem 4 --------------------------------------------------------------------

MU = 2e-4  # appendix C.2
LOCAL_STEPS = (1, 2, 5, 10, 20)
CONSTANT_LR = 0.2  # below 1/4, where C.4 proves convergence to (28)
# inverse-time: eta_t = 0.2 / (1 + 1e-4 t). C.2 anneals (1/5) / (5 + t a), i.e.
# 0.04 / (1 + t a / 5), a from {1e-2, 1e-4, 1e-6}; from 0.04 the runs take some 10^5 rounds
# to settle, so fedsub starts from the constant panel's 0.2 and decays slowly enough for the
# model to follow its lr's own limit (28) as the lr falls.
DECAY = 1e-4
TOTAL_STEPS = 16_000  # local steps per run: (28) reached to ~1e-6 relative for every E


def theorem_4(out: Path, smoke: bool, decayed: bool) -> ClosedFormResult:
    options = li_quadratic.LiQuadraticOptions()
    dataset = li_quadratic.generate(options, 0)
    optimum = li_quadratic.optimum(options, MU)
    best = li_quadratic.objective(options, MU, optimum)
    model = LinearRegression(dataset.train.dense_dim)

    def measures(params: Params) -> dict[str, float]:
        w = params.dense["weight"].numpy()
        return {
            "objective_gap": li_quadratic.objective(options, MU, w) - best,
            "distance_to_optimum": float(np.linalg.norm(w - optimum)),
        }

    steps_list = (1, 5) if smoke else LOCAL_STEPS
    rows: list[Row] = []
    curves: dict[int, list[Evaluation]] = {}
    worst = 0.0
    for steps in steps_list:
        rounds = 3 if smoke else math.ceil(TOTAL_STEPS / steps)
        schedule = Schedule(
            rounds,
            options.num_devices,
            local=LocalWork(
                steps,
                options.block + 1,
                ClientStep(
                    lr=CONSTANT_LR, weight_decay=MU, lr_schedule=_schedule(decayed), lr_decay=DECAY
                ),
            ),
            seed=0,
            execution=Execution(dtype=torch.float64),
            eval_every=max(1, rounds // 200),
        )
        history = _history(model, "fedavg", dataset, schedule, measures, heat="samples")
        curves[steps] = history
        # the limit (28) of the last round's lr (constant: the lr; decayed: where it fell to)
        last_lr = lr_at(CONSTANT_LR, schedule.client_step, rounds)
        limit = li_quadratic.fedavg_limit(options, MU, last_lr, steps)
        paper = float(np.linalg.norm(limit - optimum))
        final = history[-1].metrics["distance_to_optimum"]
        rows.append(
            (f"E={steps}: ||w - w*|| after {rounds} rounds (lr {last_lr:.3g})", paper, final)
        )
        if steps > 1:
            worst = max(worst, abs(final - paper) / paper)
        else:  # E = 1 is gradient descent: its limit is w* itself
            worst = max(worst, final / float(np.linalg.norm(optimum)))
    plot = out / ("theorem4-decayed.png" if decayed else "theorem4-constant.png")
    _plot_theorem(curves, options, decayed, plot)
    constant = {
        e: float(np.linalg.norm(li_quadratic.fedavg_limit(options, MU, CONSTANT_LR, e) - optimum))
        for e in steps_list
    }
    verdict = _theorem_verdict(rows, decayed, worst, smoke, constant)
    return ClosedFormResult(rows, verdict, plot)


def _schedule(decayed: bool) -> LrSchedule:
    return "inverse-time" if decayed else "constant"


def _theorem_verdict(
    rows: list[Row], decayed: bool, worst: float, smoke: bool, constant: dict[int, float]
) -> str:
    """fedsub's distance to w* against (28)'s at the last round's lr for every E > 1 (E = 1
    must reach w*). Decayed: the paper says FedAvg then approaches w*: each E > 1 must also
    end closer to w* than its constant-lr limit."""
    tail = " (smoke size: the runs are far from their limits)" if smoke else ""
    gap = f"{100 * worst:.2g}% of eq. (28)'s distance to w* at the last lr for E > 1"
    if worst > THEOREM_TOLERANCE:
        return f"differs: {gap} off (beyond {100 * THEOREM_TOLERANCE:g}%){tail}"
    within = f"within {gap}"
    if not decayed:
        return f"{within}, and E = 1 at w* (relative to ||w*||){tail}"
    finals = {int(r[0].split(":")[0][2:]): r[2] for r in rows}
    farther = [e for e, d in finals.items() if e > 1 and (d is None or d >= constant[e])]
    if farther:
        return (
            f"differs: with E = {farther[0]} the decayed run ends no closer to w* than the "
            f"constant-lr limit{tail}"
        )
    return f"holds: every E > 1 ends closer to w* than its constant-lr limit; {within}{tail}"


def _plot_theorem(
    curves: dict[int, list[Evaluation]],
    options: li_quadratic.LiQuadraticOptions,
    decayed: bool,
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    optimum = li_quadratic.optimum(options, MU)
    best = li_quadratic.objective(options, MU, optimum)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for steps, history in curves.items():
        line = ax.semilogy(
            [e.round for e in history],
            [max(e.metrics["objective_gap"], 1e-16) for e in history],
            label=f"E = {steps}",
        )[0]
        if not decayed and steps > 1:
            limit = li_quadratic.fedavg_limit(options, MU, CONSTANT_LR, steps)
            plateau = li_quadratic.objective(options, MU, limit) - best
            ax.axhline(plateau, color=line.get_color(), linestyle=":", linewidth=1)
    how = (
        f"eta_t = {CONSTANT_LR:g} / (1 + {DECAY:g} t)"
        if decayed
        else f"constant eta = {CONSTANT_LR:g} (dotted: eq. 28's plateau)"
    )
    ax.set_title(f"Theorem 4: FedAvg, N = 5, p = 4, mu = {MU:g}, {how}", fontsize="small")
    ax.set_xlabel("round")
    ax.set_ylabel("F(w) - F(w*)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
