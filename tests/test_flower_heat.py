"""Private heat on Flower: the leak check that tests/test_flower_node_data.py's real-process
run (a SuperLink and three SuperNodes with ``privacy.heat_source = "secagg"``) applies to what
the server received, shown to find an index set sent in the clear; settings refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsub.flower.protocols import Transcript
from fedsub.flower.records import PACKED, packed
from fedsub.flower.settings import FlowerSettings

SETTINGS = (
    "data.num_users=3",
    "train.rounds=1",  # each message starts a ClientApp process: keep the stages few
    "train.clients_per_round=2",
    "train.algorithms=['fedsubavg']",
    "train.heat='samples'",
)


def _int_lists(value: object) -> list[np.ndarray]:
    """Every list of numbers in a transcript value, and every byte string read as uint32s."""
    if isinstance(value, dict):
        if "bytes" in value:
            raw = bytes.fromhex(value["bytes"])
            usable = len(raw) - len(raw) % 4
            return [np.frombuffer(raw[:usable], dtype="<u4").astype(np.int64)]
        return [a for v in value.values() for a in _int_lists(v)]
    if isinstance(value, list):
        if value and all(isinstance(v, int | float) for v in value):
            return [np.asarray(value, dtype=np.float64)]
        return [a for v in value for a in _int_lists(v)]
    return []


def _byte_strings(value: object) -> list[bytes]:
    if isinstance(value, dict):
        if "bytes" in value:
            return [bytes.fromhex(value["bytes"])]
        return [b for v in value.values() for b in _byte_strings(v)]
    if isinstance(value, list):
        return [b for v in value for b in _byte_strings(v)]
    return []


def leaks(replies: list[dict], rows: list[dict[str, np.ndarray]], weights: list[int]) -> list:
    """(node, stage, table, client) of every received value that equals or contains a
    client's S(k): its row list (as a set, or as int32 / int64 / packed-bit bytes) or its
    indicator (0/1 or times w_k) over the table."""
    found = []
    for entry in replies:
        numbers = _int_lists(entry["records"])
        blobs = _byte_strings(entry["records"])
        for k, (own, w) in enumerate(zip(rows, weights, strict=True)):
            for table, members in own.items():
                if len(members) < 2:
                    continue
                member_set = set(members.tolist())
                encodings = [members.astype(t).tobytes() for t in ("<i4", "<i8")]
                hit = any(member_set <= set(a.tolist()) for a in numbers if len(a) < 10_000)
                for a in numbers:
                    if len(a) >= members.max() + 1:
                        indicator = np.zeros(len(a))
                        indicator[members] = 1
                        hit |= np.array_equal(a, indicator) or np.array_equal(a, w * indicator)
                        start = a[: members.max() + 1]
                        hit |= set(np.flatnonzero(start).tolist()) == member_set
                for blob in blobs:
                    hit |= any(e in blob for e in encodings)
                if hit:
                    found.append((entry["node"], entry["stage"], table, k))
    return found


def test_the_leak_check_finds_an_index_set_sent_in_the_clear():
    """The check used below can fail: a reply holding S(k) (today's exact query) is found."""
    from flwr.app import ArrayRecord, MetricRecord, RecordDict

    rows = [{"features": np.array([3, 7, 11])}, {"features": np.array([1, 2])}]
    transcript = Transcript()
    index = ArrayRecord({"rows.features": torch.tensor([3, 7, 11])})
    transcript(5, "query", RecordDict({"index": index, "metrics": MetricRecord({"p": 0})}))
    assert leaks(transcript.entries, rows, [4, 2]) == [(5, "query", "features", 0)]
    # packed, as fedsub's nodes send records (flower/records.py): found alike
    packed_index = packed({"rows.features": torch.tensor([3, 7, 11])})
    transcript(6, "query", RecordDict({"index": packed_index}))
    assert leaks(transcript.entries[1:], rows, [4, 2]) == [(6, "query", "features", 0)]
    packed_index[PACKED].data = b"no safetensors"  # a node's garbage: kept as unreadable
    transcript(7, "query", RecordDict({"index": packed_index}))
    assert transcript.entries[-1]["records"]["index"] == {
        "unreadable": "its arrays cannot be read (SafetensorError)"
    }
    vector = np.zeros(14, dtype="<u4")  # client 0's w_k * indicator, then [w_k, 1]
    vector[[3, 7, 11, 12, 13]] = [4, 4, 4, 4, 1]
    masked = {"values": {"bytes": vector.tobytes().hex()}}
    assert leaks([{"node": 6, "stage": "mask", "records": {"heat": masked}}], rows, [4, 2]) == [
        (6, "mask", "features", 0)
    ]


def test_flower_settings_refuse_schemes_that_need_private_sample_counts():
    from fedsub.errors import ConfigError

    settings = FlowerSettings(overrides=("privacy.heat_source='secagg'",))
    config = settings.fedsub_config()
    with pytest.raises(ConfigError, match="scheme 'scheme1' needs every client's sample count"):
        FlowerSettings(algorithm="fedsubavg@scheme1").algorithm_name(config)
    assert FlowerSettings(algorithm="fedsubavg@scheme2").algorithm_name(config)
    with pytest.raises(ConfigError, match="heat-transcript must be true or false, got 'yes'"):
        FlowerSettings.from_run_config({"heat-transcript": "yes"})
