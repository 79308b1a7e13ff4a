"""Issue 39 (row-sharded tables): memory per process, bytes per round and round time of
`execution.table_sharding = "rows"` under torchrun (gloo, CPU) against one process.

    python benchmarks/sharded_tables.py [--big-items 1500000] [--small-items 100000]
                                        [--limit-gb 2.5] [--algorithm fedadam-lazy]

Workload: embedding-LR (16 dims, float32) on the embedded ``synthetic-sparse`` data with
``items`` items (10 table rows per item), the default cohort (50 clients per round), a
checkpoint after round 2, the model written at the end. Each run is a fresh ``fedsub compare``
(under ``torchrun --nproc-per-node P`` for P > 1); each process reports its own peak RSS at
exit and logs the bytes it sent to the other processes each round (``fedsub.sharding``'s DEBUG
lines). Three measurements:

1. memory: the big table by one process and by P = 2 and 4 (peak RSS per process against
   ``--limit-gb``, a stated per-process limit the one-process run exceeds, and against the
   goal's bound: the fixed overhead (the small table's one-process peak) plus 1/P of the
   rest of the big table's one-process peak);
2. bytes per round at P = 2 for the small and the big table (the same cohort rows: the bytes
   must not grow with the table's rows);
3. time per round (training seconds from metrics.jsonl / rounds) of the small table by one
   process and by P = 2, in this one run. This machine has 2 cores: P = 4 shares them, so its
   times measure the machine, not the design (not reported as a ratio).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROWS_PER_ITEM = 10  # synthetic-sparse: item, gender x item (2), age x item (7)
DIM = 16
TRAFFIC = re.compile(r"round (\d+): process \d+ of \d+ sent (\d+) bytes .* for (\d+) rows")


def settings(items: int, algorithm: str, rounds: int, sharding: str) -> list[str]:
    return [
        "--set", f"data.num_items={items}",
        "--set", 'model.name="embedding-lr"',
        "--set", f"model.embedding_dim={DIM}",
        "--set", f'train.algorithms=["{algorithm}"]',
        "--set", f"train.rounds={rounds}",
        "--set", "train.checkpoint_every=2",
        "--set", f'execution.table_sharding="{sharding}"',
        "--set", f"eval.every={rounds}",
        "--set", "eval.train_loss_samples=500",
    ]  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """One process of a run: `fedsub compare`, then this process's peak RSS and traffic."""
    from fedsub import cli

    rank = os.environ.get("RANK", "0")
    log = logging.getLogger("fedsub.sharding")
    log.setLevel(logging.DEBUG)
    log.propagate = False
    handler = logging.FileHandler(Path(args.stats) / f"traffic-{rank}.log")
    log.addHandler(handler)
    sharding = "rows" if "WORLD_SIZE" in os.environ else "none"
    chosen = settings(args.items, args.algorithm, args.rounds, sharding)
    code = cli.main(["compare", *chosen, "--out", args.out, "--quiet"])
    handler.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (Path(args.stats) / f"peak-{rank}.json").write_text(json.dumps({"peak": peak}))
    if code:
        raise SystemExit(code)


def run(items: int, processes: int, args: argparse.Namespace, scratch: Path) -> dict:
    """One fresh run; its processes' peaks, bytes per round and seconds per round."""
    name = f"items{items}-p{processes}"
    out, stats = scratch / name, scratch / f"{name}-stats"
    stats.mkdir()
    mine = [
        __file__, "--worker", "--items", str(items), "--out", str(out), "--stats", str(stats),
        "--algorithm", args.algorithm, "--rounds", str(args.rounds),
    ]  # fmt: skip
    command = [sys.executable, *mine]
    if processes > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command = [*launcher, "--nproc-per-node", str(processes), *mine]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    peaks = [json.loads(p.read_text())["peak"] for p in sorted(stats.glob("peak-*.json"))]
    sent: dict[int, int] = {}
    rows: dict[int, int] = {}
    for log in stats.glob("traffic-*.log"):
        for line in log.read_text().splitlines():
            match = TRAFFIC.search(line)
            if match:
                r = int(match.group(1))
                sent[r] = sent.get(r, 0) + int(match.group(2))
                rows[r] = rows.get(r, 0) + int(match.group(3))
    metrics = [json.loads(x) for x in (out / args.algorithm / "metrics.jsonl").open()]
    seconds = metrics[-1]["elapsed"] / args.rounds
    model = (out / args.algorithm / "model.safetensors").stat().st_size
    return {
        "items": items,
        "table_rows": ROWS_PER_ITEM * items + 9,
        "table_bytes": (ROWS_PER_ITEM * items + 9) * DIM * 4,
        "processes": processes,
        "peak_rss_bytes_per_process": peaks,
        "bytes_sent_per_round_all_processes": [sent[r] for r in sorted(sent)],
        "rows_fetched_per_round_all_processes": [rows[r] for r in sorted(rows)],
        "seconds_per_round": seconds,
        "model_file_bytes": model,
        "final_train_loss": metrics[-1]["train_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--big-items", type=int, default=1_500_000)
    parser.add_argument("--small-items", type=int, default=100_000)
    parser.add_argument("--limit-gb", type=float, default=2.5)
    parser.add_argument("--algorithm", default="fedadam-lazy")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--items", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--stats", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    limit = args.limit_gb * 1e9
    results = []
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        for items, processes in [
            (args.small_items, 1),
            (args.small_items, 2),
            (args.big_items, 1),
            (args.big_items, 2),
            (args.big_items, 4),
        ]:
            result = run(items, processes, args, scratch)
            results.append(result)
            peaks = ", ".join(f"{p / 1e9:.2f}" for p in result["peak_rss_bytes_per_process"])
            within = all(p <= limit for p in result["peak_rss_bytes_per_process"])
            sent = result["bytes_sent_per_round_all_processes"]
            fetched = result["rows_fetched_per_round_all_processes"]
            print(
                f"table {result['table_bytes'] / 1e9:5.2f} GB ({result['table_rows']:,} rows)  "
                f"P={processes}  peak GB/process [{peaks}] "
                f"{'within' if within else 'OVER'} {args.limit_gb} GB  "
                f"round 1: {sent[0] if sent else 0:,} bytes for {fetched[0] if fetched else 0:,} "
                "rows  "
                f"s/round {result['seconds_per_round']:.3f}",
                flush=True,
            )
            for path in scratch.iterdir():  # free the disk between runs
                if path.is_dir() and path.name.startswith(f"items{items}-p{processes}"):
                    subprocess.run(["rm", "-rf", str(path)], check=True)
    small = [r for r in results if r["items"] == args.small_items]
    big = [r for r in results if r["items"] == args.big_items]
    overhead = small[0]["peak_rss_bytes_per_process"][0]  # interpreter, torch, data, a small table
    alone = big[0]["peak_rss_bytes_per_process"][0]
    for result in big[1:]:
        p = result["processes"]
        bound = overhead + (alone - overhead) / p
        worst = max(result["peak_rss_bytes_per_process"])
        print(
            f"P={p}: largest peak {worst / 1e9:.2f} GB, bound {bound / 1e9:.2f} GB (fixed "
            f"overhead {overhead / 1e9:.2f} + (one process {alone / 1e9:.2f} - it) / {p}): "
            f"{'met' if worst <= bound else 'MISSED'}"
        )
    ratio = small[1]["seconds_per_round"] / small[0]["seconds_per_round"]
    print(f"time per round, small table, P=2 / one process: {ratio:.2f} (2 cores)")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
