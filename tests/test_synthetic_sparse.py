"""The embedded default dataset: its promised shape, determinism and label model."""

import numpy as np

from fedsub.data.synthetic_sparse import SyntheticSparseOptions, field_offsets, generate
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.stats import table1_row


def test_default_has_heat_dispersion_of_at_least_1000():
    dataset = generate(SyntheticSparseOptions(), seed=0)
    row = table1_row(dataset, SubmodelIndex.build(dataset))
    assert row["clients"] == 3000
    assert row["heat_dispersion"] >= 1000
    assert row["heat_min"] == 1
    assert 0.3 < row["label_mean"] < 0.7


def test_same_seed_same_data_other_seed_other_data():
    options = SyntheticSparseOptions(num_users=50, num_items=20)
    a, b, c = generate(options, 1), generate(options, 1), generate(options, 2)
    np.testing.assert_array_equal(a.train.ids["features"].values, b.train.ids["features"].values)
    np.testing.assert_array_equal(a.train.labels, b.train.labels)
    assert not np.array_equal(a.train.labels, c.train.labels) or not np.array_equal(
        a.train.ids["features"].values, c.train.ids["features"].values
    )


def test_each_sample_has_one_id_per_field_and_consistent_crosses():
    options = SyntheticSparseOptions(num_users=30, num_items=25)
    dataset = generate(options, 0)
    at = field_offsets(options.num_items)
    ids = dataset.train.ids["features"].values.reshape(-1, 5)
    gender, age = ids[:, 0] - at["gender"], ids[:, 1] - at["age"]
    item = ids[:, 2] - at["item"]
    np.testing.assert_array_equal(ids[:, 3] - at["gender_x_item"], gender * 25 + item)
    np.testing.assert_array_equal(ids[:, 4] - at["age_x_item"], age * 25 + item)
    # a user's gender and age are the same in all of its samples
    owner = dataset.client_of_sample()
    for k in range(dataset.num_clients):
        assert len(set(gender[owner == k])) == 1 and len(set(age[owner == k])) == 1
    # every user keeps training data and gives about 20% to the test set
    assert np.all(dataset.sample_counts() >= 1)
    assert 0.15 < len(dataset.test) / (len(dataset.test) + len(dataset.train)) < 0.25
