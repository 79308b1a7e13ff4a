"""Issue 39 (memory per byte of table): peak resident memory of a whole `fedsub compare` run
against the bytes of its server table, with checkpoints and the final model written.

    python benchmarks/table_memory.py [--items 1000 1000000 3000000] [--algorithm fedsubavg]

Each size runs in a fresh process (`/usr/bin/time`-free: the child's peak RSS from
``resource.getrusage(RUSAGE_CHILDREN)`` after it exits): embedding-LR (16 dims, float32) on the
embedded ``synthetic-sparse`` data with ``num_items`` items (10 table rows per item: the item and
its crosses), 4 rounds, a checkpoint every 2, an evaluation every 2, the model written at the
end. The smallest size measures the fixed overhead (interpreter, torch, data, index); the
figure is ``(peak - fixed) / table bytes``: 1.0 means the run holds one table and nothing
that grows with it.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FEDSUB = Path(sys.executable).with_name("fedsub")
ROWS_PER_ITEM = 10  # synthetic-sparse: item, gender x item (2), age x item (7)
DIM = 16


def peak_of_run(items: int, algorithm: str, out: Path) -> int:
    """Peak RSS in bytes of one fresh `fedsub compare` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    subprocess.run(
        [
            str(FEDSUB),
            "compare",
            "--set", f"data.num_items={items}",
            "--set", 'model.name="embedding-lr"',
            "--set", f'train.algorithms=["{algorithm}"]',
            "--set", "train.rounds=4",
            "--set", "train.checkpoint_every=2",
            "--set", "eval.every=2",
            "--set", "eval.target_test_auc=0.99",
            "--out", str(out),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if after <= before:
        raise SystemExit("a later child did not raise the children's peak: run sizes ascending")
    return after * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, nargs="+", default=[1000, 1_000_000, 3_000_000])
    parser.add_argument("--algorithm", default="fedsubavg")
    args = parser.parse_args()
    sizes = sorted(args.items)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for items in sizes:
            out = Path(scratch) / f"items-{items}"
            peak = peak_of_run(items, args.algorithm, out)
            shutil.rmtree(out)
            table = (ROWS_PER_ITEM * items + 9) * DIM * 4
            rows.append({"items": items, "table_bytes": table, "peak_rss_bytes": peak})
    fixed = rows[0]["peak_rss_bytes"]
    for row in rows[1:]:
        row["peak_over_table"] = round(row["peak_rss_bytes"] / row["table_bytes"], 3)
        row["peak_minus_fixed_over_table"] = round(
            (row["peak_rss_bytes"] - fixed) / row["table_bytes"], 3
        )
    for row in rows:
        print(
            f"{row['items']:>10,} items  table {row['table_bytes'] / 1e9:6.2f} GB  "
            f"peak {row['peak_rss_bytes'] / 1e9:6.2f} GB  "
            f"(peak - fixed) / table {row.get('peak_minus_fixed_over_table', '-')}"
        )
    print("RESULT " + json.dumps({"algorithm": args.algorithm, "fixed_bytes": fixed, "runs": rows}))


if __name__ == "__main__":
    main()
