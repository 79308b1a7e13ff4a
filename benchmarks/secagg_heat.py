"""Secure aggregation of heat counts: 100 clients x 100,000 indices, end to end.

Each client holds a Zipf-distributed index set and submits its indicator vector through the
full protocol (keys, encrypted shares, masked input, unmasking). Reports wall time and the
bytes each client sends, and checks the sum against the plain count.

    python benchmarks/secagg_heat.py [--clients 100] [--indices 100000]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

from fedsub.privacy.secagg import secure_sum


def message_bytes(message: object) -> int:
    """Serialized size of a protocol message: bytes as is, arrays by nbytes, ints 4 bytes,
    Shamir shares 4 + 66 bytes."""
    if isinstance(message, bytes):
        return len(message)
    if isinstance(message, np.ndarray):
        return message.nbytes
    if isinstance(message, int):
        return 4
    if isinstance(message, tuple | list):
        return sum(message_bytes(m) for m in message)
    if isinstance(message, dict):
        return sum(4 + message_bytes(v) for v in message.values())
    if dataclasses.is_dataclass(message):
        return sum(message_bytes(getattr(message, f.name)) for f in dataclasses.fields(message))
    raise TypeError(type(message))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--indices", type=int, default=100_000)
    parser.add_argument("--items-per-client", type=int, default=200)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    popularity = 1 / np.arange(1, args.indices + 1) ** 1.1
    popularity /= popularity.sum()
    vectors = {}
    for k in range(args.clients):
        vector = np.zeros(args.indices, dtype=np.uint32)
        vector[rng.choice(args.indices, size=args.items_per_client, p=popularity)] = 1
        vectors[k] = vector
    threshold = args.clients // 2 + 1

    sent: dict[str, list[int]] = {"advertise": [], "shares": [], "masked": [], "unmask": []}
    import fedsub.privacy.secagg as secagg

    originals = {
        "advertise": secagg.SecAggClient.advertise,
        "shares": secagg.SecAggClient.share_keys,
        "masked": secagg.SecAggClient.masked_input,
        "unmask": secagg.SecAggClient.unmask,
    }

    def counting(step, method):
        def wrapped(self, *a, **kw):
            message = method(self, *a, **kw)
            sent[step].append(message_bytes(message))
            return message

        return wrapped

    for step, method in originals.items():
        setattr(
            secagg.SecAggClient,
            {
                "advertise": "advertise",
                "shares": "share_keys",
                "masked": "masked_input",
                "unmask": "unmask",
            }[step],
            counting(step, method),
        )
    started = time.perf_counter()
    total, server = secure_sum(vectors, threshold)
    seconds = time.perf_counter() - started
    expected = sum(v.astype(np.uint64) for v in vectors.values()).astype(np.uint32)
    assert np.array_equal(total, expected) and not server.rejections

    per_client = {step: float(np.mean(sizes)) for step, sizes in sent.items()}
    result = {
        "clients": args.clients,
        "indices": args.indices,
        "threshold": threshold,
        "wall_seconds": round(seconds, 3),
        "bytes_sent_per_client": {k: int(v) for k, v in per_client.items()},
        "bytes_sent_per_client_total": int(sum(per_client.values())),
        "plain_indicator_bytes": args.indices * 4,
        "sum_correct": True,
    }
    print(
        f"{args.clients} clients x {args.indices} indices: {seconds:.2f} s; "
        f"{result['bytes_sent_per_client_total'] / 1e6:.3f} MB sent per client"
    )
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
