"""Private heat on a real Flower deployment (a SuperLink and three SuperNodes): with
``train.heat_source = "secagg"`` the heat is exact, the model is the exact-heat run's, and
nothing the server received in the query round and the heat exchange holds a node's S(k)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedsub import config as config_lib
from fedsub.experiment import load_data
from fedsub.flower.heat_exchange import Transcript
from fedsub.flower.settings import FlowerSettings
from fedsub.submodel import heat as heat_lib
from fedsub.submodel.index import SubmodelIndex

from .processes import Processes, flower_env, free_ports, wait_for
from .test_flower import BIN, in_process_model, start_insecure_federation, submit_example

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
    vector = np.zeros(14, dtype="<u4")  # client 0's w_k * indicator, then [w_k, 1]
    vector[[3, 7, 11, 12, 13]] = [4, 4, 4, 4, 1]
    masked = {"values": {"bytes": vector.tobytes().hex()}}
    assert leaks([{"node": 6, "stage": "mask", "records": {"heat": masked}}], rows, [4, 2]) == [
        (6, "mask", "features", 0)
    ]


def test_secagg_heat_on_real_processes_is_exact_and_the_server_never_sees_an_index_set(
    tmp_path,
):
    link, *node_ports = free_ports(4)
    env = flower_env(tmp_path, link, "insecure = true", BIN)
    processes = Processes(tmp_path, env, BIN)
    out = tmp_path / "out"
    private = (*SETTINGS, "train.heat_source='secagg'", "train.secagg_group=3")
    try:
        start_insecure_federation(processes, tmp_path, link, node_ports)
        run_config = (
            f'set="{"; ".join(private)}" out-dir="{out}" round-timeout=30.0 heat-transcript=true'
        )
        submit_example(env, run_config)
        wait_for(lambda: (out / "flower-result.json").exists(), 240, "the run to finish")
    finally:
        processes.stop_all()

    result = json.loads((out / "flower-result.json").read_text())
    assert result["succeeded"] and [r["replies"] for r in result["rounds"]] == [2]
    config = config_lib.load(None, list(SETTINGS))
    dataset = load_data(config)
    index = SubmodelIndex.build(dataset)
    counts = dataset.sample_counts()
    heat = load_file(out / "heat.safetensors")
    for table, size in dataset.table_rows.items():
        exact = heat_lib.heat(index.rows[table], size, counts, "samples")
        np.testing.assert_array_equal(heat[f"heat.{table}"].numpy(), exact)
    flower = load_file(out / "model.safetensors")
    for name, value in in_process_model(SETTINGS).items():  # the exact-heat run
        torch.testing.assert_close(flower[name], value, rtol=0, atol=1e-5)
    assert float(flower["table.features"].abs().sum()) > 0  # it trained

    transcript = json.loads((out / "heat-transcript.json").read_text())
    replies = transcript["replies"]
    stages = [r["stage"] for r in replies]
    assert {s: stages.count(s) for s in set(stages)} == {
        "query": 3,
        "advertise": 3,
        "share": 3,
        "mask": 3,
        "unmask": 3,
    }
    rows = [{t: index.client_rows(t, k) for t in dataset.table_rows} for k in range(3)]
    assert leaks(replies, rows, counts.tolist()) == []
    assert "num-examples" not in json.dumps(replies)  # sample counts only inside the sum


def test_flower_settings_refuse_schemes_that_need_private_sample_counts():
    from fedsub.errors import ConfigError

    settings = FlowerSettings(overrides=("train.heat_source='secagg'",))
    config = settings.fedsub_config()
    with pytest.raises(ConfigError, match="scheme 'scheme1' needs every client's sample count"):
        FlowerSettings(algorithm="fedsubavg@scheme1").algorithm_name(config)
    assert FlowerSettings(algorithm="fedsubavg@scheme2").algorithm_name(config)
    with pytest.raises(ConfigError, match="heat-transcript = 'yes'; expected true or false"):
        FlowerSettings.from_run_config({"heat-transcript": "yes"})
