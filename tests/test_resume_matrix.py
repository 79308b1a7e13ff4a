"""Resume gives an uninterrupted run's model, for every algorithm x every model.

Each case trains 3 rounds straight through, then trains again, stops after round 1 (the
checkpoint goes through safetensors files on disk, as with Ctrl-C), builds the algorithm
afresh from the registry as a new process would, resumes, and compares every tensor.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest
import torch

from fedsub.algorithms.registry import AlgorithmContext, algorithm_names, build_algorithm
from fedsub.data.amazon import AmazonFilesOptions, load_fedsubavg_files
from fedsub.data.sent140 import Sent140Options
from fedsub.data.sent140 import load as load_sent140
from fedsub.data.synthetic_li import SyntheticLiOptions
from fedsub.data.synthetic_li import generate as generate_li
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.loop import Interrupted, RunControl
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.models.registry import build_model, model_names
from fedsub.submodel.index import SubmodelIndex

from .test_amazon_din import write_user_files
from .test_backends import two_tables_with_dense
from .test_sent140_lstm import tweets, write_csv
from .torch_modules import ANY_DATA, wrapped

ROUNDS, STOP_AFTER = 3, 1
# registry names, plus the sampling/weighting schemes a user can attach with "@"
ALGORITHMS = [
    *algorithm_names(),
    "fedavg@scheme1",
    "fedavg@scheme2",
    "fedsubavg@transformed-scheme2",
    "scaffold@scheme1",
]
# (torch-module's `module`: a factory of tests/torch_modules.py that fits any dataset)
OPTIONS = {"init_std": 0.1, "embedding_dim": 3, "widths": [], "scaler": True, "module": ANY_DATA}
SMALL_WIDTHS = {"cnn": [2, 3], "mlp": [5, 4], "resnet18": [2, 2, 2, 2]}
SMALLER = {"lstm": {"hidden": 6, "embedding_dim": 4}}  # fields the registry does not expose


def smaller(model, name: str):
    """``model`` with ``SMALLER``'s sizes for ``name`` (built-in models are dataclasses)."""
    return dataclasses.replace(model, **SMALLER[name]) if name in SMALLER else model


# the batched ResNet is ~20x slower at this size; test_backends checks the backends agree
BACKEND = {"resnet18": "sequential"}


@cache
def dataset_for(model: str, folder: str):
    """A few clients' worth of data in the shape ``model`` reads."""
    from pathlib import Path

    if model in ("sparse-lr", "embedding-lr", "torch-module"):
        dataset = two_tables_with_dense(0)
    elif model.startswith("torch-module:"):  # a wrapped user module (tests/torch_modules.py)
        dataset = wrapped(model)[1]
    elif model == "din":
        files = write_user_files(Path(folder) / "amazon", users=6, lines=8)
        dataset = load_fedsubavg_files(AmazonFilesOptions(), str(files), 0)
    elif model == "lstm":
        path = Path(folder) / "tweets.csv"
        write_csv(path, list(tweets(users=4, per_user=50)))
        dataset = load_sent140(Sent140Options(vocab_size=12, max_tokens=5), str(path), 0)
    elif model == "cnn":  # dense inputs read as 16 x 16 images (the CNN's smallest)
        dataset = generate_li(SyntheticLiOptions(num_devices=4, dim=256, classes=3), 0)
    elif model == "resnet18":  # 8 x 8 images
        dataset = generate_li(SyntheticLiOptions(num_devices=4, dim=64, classes=3), 0)
    else:
        dataset = generate_li(SyntheticLiOptions(num_devices=6, dim=5, classes=3), 0)
    return dataset, SubmodelIndex.build(dataset)


def run(model, name, dataset, index, schedule, control=None):
    algorithm = build_algorithm(name, AlgorithmContext(dataset, index, "samples"))
    return train(model, algorithm, dataset, index, schedule, control=control)


@pytest.mark.parametrize("model_name", model_names())
@pytest.mark.parametrize("name", ALGORITHMS)
def test_interrupt_then_resume_equals_an_uninterrupted_run(name, model_name, tmp_path_factory):
    dataset, index = dataset_for(model_name, str(tmp_path_factory.getbasetemp()))
    options = {**OPTIONS, "widths": SMALL_WIDTHS.get(model_name, [])}
    model = smaller(build_model(model_name, dataset, options), model_name)
    backend = BACKEND.get(model_name, "batched")
    schedule = Schedule(
        ROUNDS,
        2,
        local=LocalWork(2, 3, ClientStep(lr=0.1)),
        seed=3,
        execution=Execution(dtype=torch.float64, backend=backend),
    )
    straight = run(model, name, dataset, index, schedule)

    folder = tmp_path_factory.mktemp("ckpt")
    rounds_done: list[int] = []
    stop = RunControl(checkpoints=folder, stop_requested=lambda: rounds_done[-1] >= STOP_AFTER)
    with pytest.raises(Interrupted) as stopped:
        train(
            model,
            build_algorithm(name, AlgorithmContext(dataset, index, "samples")),
            dataset,
            index,
            schedule,
            on_round=rounds_done.append,
            control=stop,
        )
    assert stopped.value.round == STOP_AFTER
    saved = checkpoint_lib.load(stopped.value.checkpoint)
    resumed = run(model, name, dataset, index, schedule, RunControl(resume=saved))

    moved = False
    for key, expected in straight.state_dict().items():
        got = resumed.state_dict()[key]
        assert got.shape == expected.shape, key
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12, msg=key)
        moved |= bool((expected != 0).any())
    assert moved  # the models did train, so equality says something
