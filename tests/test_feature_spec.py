"""The shared feature spec: stable hashed ids, a content hash that catches a different or
edited spec, vocabularies with a reserved unknown row, and errors naming file and line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fedsub.data.feature_spec import (
    FeatureSpec,
    FieldSpec,
    NodeFiles,
    check_same_spec,
    dataset_of_nodes,
    hashed_row,
    read_spec,
)
from fedsub.data.table import TABLE
from fedsub.errors import DataError

from .node_files import HEADER, SPEC, write_federation

PROBE = (
    "from fedsub.data.feature_spec import hashed_row, read_spec; import sys; "
    "print(hashed_row('item', 'i17', 1000003), read_spec(sys.argv[1]).hash)"
)


def test_hashed_ids_and_the_spec_hash_are_the_same_in_every_process(tmp_path):
    SPEC.write(tmp_path / "spec.json")
    here = f"{hashed_row('item', 'i17', 1000003)} {read_spec(tmp_path / 'spec.json').hash}"
    # independent reference: blake2b of "column:value", 8 bytes little-endian, mod buckets
    digest = hashlib.blake2b(b"item:i17", digest_size=8).digest()
    assert hashed_row("item", "i17", 1000003) == int.from_bytes(digest, "little") % 1000003
    for seed in ("1", "2"):  # Python's salted str hash differs between these processes
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", PROBE, str(tmp_path / "spec.json")],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.split() == here.split()


def test_spec_round_trips_and_a_different_or_edited_spec_is_refused(tmp_path):
    SPEC.write(tmp_path / "spec.json")
    read = read_spec(tmp_path / "spec.json")
    assert read.hash == SPEC.hash and read.table_rows == {TABLE: 64 + 16 + 32 + 4}
    newer = FeatureSpec(3, (*SPEC.fields[:3], FieldSpec("country", vocabulary=("de", "fr"))))
    with pytest.raises(DataError) as refused:
        check_same_spec(newer, SPEC.version, SPEC.hash, "node partition-id=1")
    message = str(refused.value)
    assert "node partition-id=1" in message and "version 3" in message and "version 2" in message
    assert newer.hash[:12] in message and SPEC.hash[:12] in message
    check_same_spec(read, SPEC.version, SPEC.hash, "node")  # the same spec passes
    raw = json.loads((tmp_path / "spec.json").read_text())
    raw["fields"][0]["buckets"] = 65  # edited by hand, hash left as it was
    (tmp_path / "edited.json").write_text(json.dumps(raw))
    with pytest.raises(DataError, match=r"edited.json: its hash \w+ does not match its content"):
        read_spec(tmp_path / "edited.json")


def test_vocabulary_rows_follow_the_file_and_unknown_values_take_the_reserved_row(tmp_path):
    (tmp_path / "cities.txt").write_text("paris\nrome\n")
    (tmp_path / "spec.json").write_text(
        json.dumps(
            {
                "format": 1,
                "version": 1,
                "fields": [{"column": "city", "vocabulary_file": "cities.txt"}],
            }
        )
    )
    spec = read_spec(tmp_path / "spec.json")
    inline = FeatureSpec(1, (FieldSpec("city", vocabulary=("paris", "rome")),))
    assert spec.hash == inline.hash  # the hash covers the values, wherever they are written
    (tmp_path / "data.csv").write_text("label,city\n1,rome\n0,paris\n1,oslo\n")
    samples = spec.encode(tmp_path / "data.csv")
    assert samples.ids[TABLE].values.tolist() == [2, 1, 0]  # oslo -> the unknown row 0


def test_bad_files_are_refused_naming_file_and_line_or_key(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"format": 1,\n "version": 1,\n "fields": [\n}')
    with pytest.raises(DataError, match=r"bad.json, line 4: not valid JSON"):
        read_spec(bad_json)
    (tmp_path / "twice.txt").write_text("a\nb\na\n")
    twice = tmp_path / "twice.json"
    twice.write_text(json.dumps({"format": 1, "version": 1, "fields": [
        {"column": "c", "vocabulary_file": "twice.txt"}]}))  # fmt: skip
    with pytest.raises(DataError, match=r"twice.txt, line 3: 'a' repeats line 1"):
        read_spec(twice)
    for fields, expected in (
        ([{"column": "c", "buckets": 0}], r"fields\[0\].buckets = 0; expected an integer >= 1"),
        ([{"column": "c"}], r"needs exactly one of buckets, vocabulary"),
        ([{"column": "a*b", "vocabulary": ["x"]}], r"a cross takes hashed ids"),
        ([{"column": "c", "bucket": 3}], r"unknown key fields\[0\].bucket"),
    ):
        path = tmp_path / "spec.json"
        path.write_text(json.dumps({"format": 1, "version": 1, "fields": fields}))
        with pytest.raises(DataError, match=expected):
            read_spec(path)
    path.write_text(
        json.dumps({"format": 1, "version": 0, "fields": [{"column": "c", "buckets": 2}]})
    )
    with pytest.raises(DataError, match=r"spec.json: version = 0; expected an integer >= 1"):
        read_spec(path)
    data = tmp_path / "node.csv"
    data.write_text(HEADER + "u,1,i1,,de,3\nu,2,i2,,fr,4\n")
    with pytest.raises(DataError, match=r"node.csv, line 3: label must be 0 or 1, got '2'"):
        SPEC.encode(data)
    data.write_text(HEADER + "u,1,i1,,de,3\nu,0,i2,,fr,cheap\n")
    with pytest.raises(DataError, match=r"node.csv, line 3: price must be a number, got 'cheap'"):
        SPEC.encode(data)
    data.write_text("label,item\n1,i1\n")
    with pytest.raises(DataError, match=r"no column 'price' \(the feature spec version 2"):
        SPEC.encode(data)


def test_node_files_hold_out_the_same_rows_every_time_and_pool_into_one_dataset(tmp_path):
    federation = write_federation(tmp_path)
    node = federation.nodes[0]
    first, second = node.read(SPEC), node.read(SPEC)
    assert 0 < len(first[1]) < 30 and len(first[0]) + len(first[1]) == 30
    np.testing.assert_array_equal(first[1].labels, second[1].labels)
    np.testing.assert_array_equal(first[1].ids[TABLE].values, second[1].ids[TABLE].values)
    with pytest.raises(DataError, match="eval-file or an eval-fraction, not both"):
        NodeFiles(node.data_file, federation.server_test_file, 0.2)
    dataset = dataset_of_nodes(SPEC, federation.nodes)
    assert dataset.num_clients == 3 and dataset.table_rows == SPEC.table_rows
    held_out = sum(len(n.read(SPEC)[1]) for n in federation.nodes)
    assert len(dataset.test) == held_out and dataset.train.dense_dim == 1
    # the numeric column is standardized with the spec's statistics: (price - 20) / 10
    price = float((tmp_path / "node0.csv").read_text().splitlines()[1].split(",")[-1])
    assert np.isclose(SPEC.encode(tmp_path / "node0.csv").dense[0, 0], (price - 20) / 10)


def test_a_spec_and_a_vocabulary_written_with_a_byte_order_mark_read_as_without(tmp_path):
    """Windows editors may start UTF-8 files with a BOM: it is not part of the first value
    (else "paris" would be an unknown value) nor a JSON error."""
    (tmp_path / "cities.txt").write_bytes(b"\xef\xbb\xbfparis\r\nrome\r\n")
    spec = {
        "format": 1,
        "version": 1,
        "fields": [{"column": "city", "vocabulary_file": "cities.txt"}],
    }
    (tmp_path / "spec.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(spec).encode())
    read = read_spec(tmp_path / "spec.json")
    assert read.hash == FeatureSpec(1, (FieldSpec("city", vocabulary=("paris", "rome")),)).hash


def test_the_nodes_dataset_reads_a_deployments_files_as_dataset_of_nodes(tmp_path):
    """``data.name = "nodes"``: the spec and one file per node, as ``dataset_of_nodes`` reads
    them (client k = node k, held-out samples pooled); lists of the wrong length refused."""
    from fedsub import config as config_lib
    from fedsub.data.feature_spec import dataset_of_nodes
    from fedsub.errors import DataError
    from fedsub.runs.run_setup import load_data

    from .node_files import SPEC, write_federation

    federation = write_federation(tmp_path)
    files = [str(n.data_file) for n in federation.nodes]
    evals = [str(n.eval_file) if n.eval_file else "" for n in federation.nodes]
    keys = (
        "data.name='nodes'",
        f"data.feature_spec='{federation.spec_file}'",
        f"data.files={files}",
        f"data.eval_files={evals}",
        "data.eval_fraction=0.3",
        "data.eval_seeds=[0, 1, 2]",
    )
    dataset = load_data(config_lib.load(None, keys))
    expected = dataset_of_nodes(SPEC, federation.nodes)
    assert dataset.num_clients == 3 and dataset.table_rows == expected.table_rows
    np.testing.assert_array_equal(dataset.sample_counts(), expected.sample_counts())
    np.testing.assert_array_equal(dataset.test.labels, expected.test.labels)
    with pytest.raises(DataError, match=r"data\.eval_seeds has 2 entries, data\.files 3"):
        load_data(config_lib.load(None, (*keys, "data.eval_seeds=[0, 1]")))
    with pytest.raises(DataError, match=r"needs data\.feature_spec"):
        load_data(config_lib.load(None, ("data.name='nodes'",)))
