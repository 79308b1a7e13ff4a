"""Reading a Flower message's records: a reply from another node is checked, not trusted."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedsub.errors import FedsubError
from fedsub.flower.records import number_of, read_deltas, record_of


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
