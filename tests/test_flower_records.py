"""Reading a Flower message's records: a reply from another node is checked, not trusted."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedsub.errors import FedsubError
from fedsub.flower.records import PACKED, number_of, packed, read_deltas, record_of, tensors_of


def test_record_of_returns_the_record_of_the_kind_asked_for():
    deltas = ArrayRecord({"table.items": torch.ones(2, 3)})
    content = RecordDict({"deltas": deltas, "metrics": MetricRecord({"num-examples": 4})})
    found = record_of(content, "deltas", ArrayRecord)
    assert torch.equal(read_deltas(found).tables["items"], torch.ones(2, 3))
    assert number_of(record_of(content, "metrics", MetricRecord), "num-examples") == 4


def test_a_record_of_another_kind_is_named_in_the_error():
    content = RecordDict({"deltas": MetricRecord({"num-examples": 4})})
    with pytest.raises(FedsubError, match="'deltas' is a MetricRecord, expected ArrayRecord"):
        record_of(content, "deltas", ArrayRecord)


@pytest.mark.parametrize("value", [[1, 2], "3", b"3", True])
def test_number_of_refuses_anything_but_one_number(value):
    config = ConfigRecord({"lr": value})
    with pytest.raises(FedsubError, match=r"'lr' is .*, expected a number"):
        number_of(config, "lr")


def test_number_of_keeps_ints_and_floats():
    config = ConfigRecord({"round": 3, "lr": 0.25})
    assert number_of(config, "round") == 3 and isinstance(number_of(config, "round"), int)
    assert number_of(config, "lr") == 0.25


def _objects(content: RecordDict) -> int:
    """The objects Flower moves for a message of ``content``: the message and its tree."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return 1 + len(get_all_nested_objects(content))


def test_a_packed_record_is_one_array_of_the_tensors_bit_for_bit_and_fewer_objects():
    """``packed``: a record's tensors as one safetensors Array, read back by ``tensors_of``
    with every name, dtype, shape and bit (a NaN's payload and -0.0 included); a train
    message of three tensors is 6 objects on the wire packed, 10 as Flower's one Array each."""
    tensors = {
        "rows.items": torch.tensor([3, 0, 7], dtype=torch.int64),
        "table.items": torch.tensor([[1.5, -0.0], [float("nan"), 2.0**-140], [1e30, -3.0]]),
        "dense.bias": torch.tensor(0.25, dtype=torch.float64),
    }
    record = packed(tensors)
    assert list(record.keys()) == [PACKED] and record[PACKED].stype == "safetensors"
    read = tensors_of(record)
    assert sorted(read) == sorted(tensors)
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape
        assert read[name].numpy().tobytes() == tensor.numpy().tobytes()
    assert tensors_of(ArrayRecord(tensors)).keys() == tensors.keys()  # Flower's records too
    config = ConfigRecord({"round": 1})
    assert _objects(RecordDict({"arrays": record, "config": config})) == 6
    assert _objects(RecordDict({"arrays": ArrayRecord(tensors), "config": config})) == 10
    assert tensors_of(packed({})) == {}


def test_a_packed_record_that_is_not_one_is_refused_naming_what_is_wrong():
    record = packed({"table.items": torch.ones(2, 3)})
    record["table.other"] = Array(torch.ones(1))
    with pytest.raises(FedsubError, match="packed arrays come with 1 other array"):
        tensors_of(record)
    record = packed({"table.items": torch.ones(2, 3)})
    record[PACKED].stype = "numpy.ndarray"
    with pytest.raises(FedsubError, match=r"packed arrays are 'numpy\.ndarray', not safetensors"):
        tensors_of(record)
    record = packed({"table.items": torch.ones(2, 3)})
    record[PACKED].data = record[PACKED].data[:-5]
    with pytest.raises(FedsubError, match=r"its arrays cannot be read \(SafetensorError\)"):
        tensors_of(record)
