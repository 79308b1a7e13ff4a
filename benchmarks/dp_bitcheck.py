"""A bit-for-bit check of DP's numbers across a speed change: runs the cost benchmark's forms
(``dp_ftrl.py``: the two amplified Gaussian ones and the tree's and BLT's dense, private,
windowed and capped ones) and the capped rule's (``ftrl_rule_grid.py --configs rule``)
seeded (``dp.randomness = "seeded"``, NOT a guarantee), and prints per form a hash of the
final model's bytes and of its epsilon lines (every evaluation's and the summary's).

    python benchmarks/dp_bitcheck.py [--rounds 60] [--rule-rounds 120] [--methods PREFIX,...]

Record the lines before a change and compare them after: any difference is a changed number.
Ends with ``RESULT {json}`` (form -> [model hash, epsilon hash]).
"""

from __future__ import annotations

import argparse
import hashlib
import json

import dp_ftrl
import ftrl_rule_grid
from fedsub.config import Config
from fedsub.runs import experiment


def hashes(overrides: list[str], algorithm: str) -> tuple[str, str]:
    """The sha256 (first 16 hex digits) of the final parameters' bytes and of the epsilon
    lines of one seeded run."""
    config = Config.from_toml(None, [*overrides, f"train.algorithms=['{algorithm}']"])
    outcome = experiment.compare(config, None)
    model = hashlib.sha256()
    params = outcome.params[algorithm]
    for name, tensor in sorted(params.state_dict().items()):  # type: ignore[union-attr]
        model.update(name.encode())
        model.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    lines = [repr(e.metrics.get("epsilon")) for e in outcome.histories[algorithm]] + [
        json.dumps(outcome.summary["algorithms"][algorithm].get("dp"), sort_keys=True)
    ]
    epsilon = hashlib.sha256("\n".join(lines).encode())
    return model.hexdigest()[:16], epsilon.hexdigest()[:16]


def forms(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(label, algorithm, overrides) of every form checked."""
    base = [
        f"train.clients_per_round={args.clients_per_round}",
        "execution.threads=1",
        "dp.randomness='seeded'",
        "dp.clip=0.5",
    ]
    short = [*base, f"train.rounds={args.rounds}", "eval.every=10"]
    noised = [*short, "dp.noise_multiplier=1.0"]
    out = [(label, alg, [*noised, *dp]) for label, alg, dp in dp_ftrl.methods(args)]
    args.configs = ["rule"]
    rule, alg = ftrl_rule_grid.overrides("rule", args, 2.0)
    out.append(
        (
            "rule eps=2",
            alg,
            [*base, f"train.rounds={args.rule_rounds}", "eval.every=20",
             "dp.target_epsilon=2.0", *rule],
        )
    )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--rule-rounds", type=int, default=120)
    parser.add_argument("--methods", type=lambda t: t.split(","), default=[])
    args = parser.parse_args()
    defaults = dict(
        clients_per_round=50, separation=50, window=25, bound=6.0, heat_cap=4.0, max_rows=200,
        capped_window=10, capped_heat_cap=16.0, capped_share=0.25,
        ftrl_mechanisms=["ftrl-tree", "ftrl-blt"], rule_epsilon=0.0,
    )  # fmt: skip
    for key, value in defaults.items():
        setattr(args, key, value)
    selected, args.methods = args.methods, []  # dp_ftrl.methods: every form, filtered here
    result = {}
    for label, algorithm, overrides in forms(args):
        if selected and not any(label.startswith(w) for w in selected):
            continue
        result[label] = hashes(overrides, algorithm)
        print(label, *result[label], flush=True)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
