import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedsub.data.federated import SampleSet
from fedsub.data.ragged import Ragged

lists_of_ids = st.lists(st.lists(st.integers(0, 50), max_size=6), min_size=1, max_size=20)


@given(lists_of_ids, st.data())
def test_take_matches_python_indexing(lists, data):
    ragged = Ragged.from_lists(lists)
    index = data.draw(st.lists(st.integers(0, len(lists) - 1), max_size=30))
    taken = ragged.take(np.array(index, dtype=np.int64))
    expected = [lists[i] for i in index]
    assert [
        taken.values[a:b].tolist()
        for a, b in zip(taken.offsets[:-1], taken.offsets[1:], strict=True)
    ] == (expected)


@given(lists_of_ids, st.data())
def test_slice_and_concat_round_trip(lists, data):
    ragged = Ragged.from_lists(lists)
    cut = data.draw(st.integers(0, len(lists)))
    joined = Ragged.concat([ragged.slice(0, cut), ragged.slice(cut, len(lists))])
    np.testing.assert_array_equal(joined.values, ragged.values)
    np.testing.assert_array_equal(joined.offsets, ragged.offsets)


def test_inconsistent_offsets_are_rejected():
    with pytest.raises(ValueError, match="offsets end at 3 but there are 2 values"):
        Ragged(np.array([1, 2]), np.array([0, 3]))


def test_sample_sets_concatenate_with_or_without_dense_features_but_not_mixed():
    ids = {"t": Ragged.from_lists([[1], [2, 3]])}
    with_dense = SampleSet(ids, np.zeros(2, np.float32), np.ones((2, 3), np.float32))
    without = SampleSet(ids, np.ones(2, np.float32))
    both = SampleSet.concat([with_dense, with_dense])
    assert both.dense is not None and both.dense.shape == (4, 3)
    assert SampleSet.concat([without, without]).dense is None
    with pytest.raises(ValueError, match="some parts have dense features, others none"):
        SampleSet.concat([with_dense, without])
