"""synthetic(alpha, beta) of seed 004 and the softmax regression model that goes with it."""

import numpy as np
import torch

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.data.synthetic_li import SyntheticLiOptions, generate
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.models.softmax_regression import SoftmaxRegression
from fedsub.submodel.index import SubmodelIndex


def device_mean_spread(dataset) -> float:
    means = [dataset.client(k).dense.mean(0) for k in range(dataset.num_clients)]
    return float(np.std(np.stack(means), axis=0).mean())


def test_shape_power_law_counts_and_determinism():
    options = SyntheticLiOptions(num_devices=30)
    a, b = generate(options, 4), generate(options, 4)
    assert a.num_clients == 30 and a.train.dense.shape[1] == 60
    totals = a.sample_counts() + np.bincount(np.zeros(0, dtype=int), minlength=30)
    assert totals.min() >= 40  # >= 50 per device before the 20% test split
    assert set(np.unique(a.train.labels)) <= set(range(10))
    np.testing.assert_array_equal(a.train.dense, b.train.dense)
    counts = a.sample_counts()
    assert counts.max() > 5 * np.median(counts)  # heavy-tailed (lognormal sigma 2)


def test_beta_controls_how_far_device_feature_means_spread():
    low = generate(SyntheticLiOptions(num_devices=40, beta=0.0), 1)
    high = generate(SyntheticLiOptions(num_devices=40, beta=3.0), 1)
    assert device_mean_spread(high) > 1.5 * device_mean_spread(low)


def test_softmax_regression_learns_on_synthetic_li():
    dataset = generate(SyntheticLiOptions(num_devices=20), 2)
    index = SubmodelIndex.build(dataset)
    model = SoftmaxRegression(60, 10)
    evaluator = Evaluator.build(model, dataset, 2000, 0)
    schedule = Schedule(
        15, 5, LocalWork(10, 24, ClientStep(0.1)), seed=0, execution=Execution(dtype=torch.float64)
    )
    algorithm = build_algorithm("fedavg", AlgorithmContext(dataset, index, "samples", 5))
    history = []
    train(model, algorithm, dataset, index, schedule, evaluator, on_evaluation=history.append)
    assert abs(history[0].metrics["train_loss"] - np.log(10)) < 1e-12  # w_0 = 0: uniform
    assert history[-1].metrics["train_loss"] < 0.8 * np.log(10)
    assert history[-1].metrics["test_accuracy"] > 0.4
