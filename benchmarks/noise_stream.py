"""Issue 50 (goal 4): the keyed Gaussian of DP-FTRL's noise (dp/tree_noise.py ``entry_noise``),
stream version 1 (Box-Muller) against version 2 (the ziggurat, dp/ziggurat.py), side by side
in one process.

    python benchmarks/noise_stream.py [--widths 1,4,16] [--sizes 200,20009] [--repeats 7]
                                      [--calls 200]

For each (width, rows): ``--repeats`` alternating pairs of timings, each the mean of
``--calls`` calls of ``entry_noise`` on the same rows (level 0, node 5: a BLT round's z, or
a tree leaf) under a version-1 and a version-2 key; prints the median microseconds of each
and the ratio v1 / v2 (the medians of the pairs' ratios), and the machine's load average.
Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from fedsub.dp import tree_noise
from fedsub.dp.tree_noise import StreamKey


def timed(key: bytes, rows: np.ndarray, width: int, calls: int) -> float:
    """Mean seconds of one ``entry_noise`` call over ``calls`` calls."""
    levels, nodes = np.zeros(len(rows), np.int64), np.full(len(rows), 5)
    start = time.perf_counter()
    for _ in range(calls):
        tree_noise.entry_noise(key, rows, levels, nodes, width)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1,4,16")
    parser.add_argument("--sizes", default="200,20009")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    secret = bytes(np.random.default_rng(0).integers(0, 256, 32, dtype=np.uint8))
    keys = {1: StreamKey(secret, 1), 2: StreamKey(secret, 2)}
    load = os.getloadavg()
    result = []
    for width in (int(w) for w in args.widths.split(",")):
        for size in (int(s) for s in args.sizes.split(",")):
            rows = np.arange(size)
            for key in keys.values():  # warm: the encryptors, the tables, the allocator
                timed(key, rows, width, 3)
            times: dict[int, list[float]] = {1: [], 2: []}
            for _ in range(args.repeats):  # alternating pairs
                for version, key in keys.items():
                    times[version].append(timed(key, rows, width, args.calls))
            ratios = [a / b for a, b in zip(times[1], times[2], strict=True)]
            line = {
                "width": width,
                "rows": size,
                "v1_us": round(statistics.median(times[1]) * 1e6, 1),
                "v2_us": round(statistics.median(times[2]) * 1e6, 1),
                "ratio": round(statistics.median(ratios), 2),
            }
            print(line, flush=True)
            result.append(line)
    after = os.getloadavg()
    print(f"load average before {load[0]:.2f}, after {after[0]:.2f}")
    print("RESULT " + json.dumps({"load": [load[0], after[0]], "rows": result}))


if __name__ == "__main__":
    main()
