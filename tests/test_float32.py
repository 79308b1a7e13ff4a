"""numerics/float32.py: a run turns TensorFloat-32 off and gives the caller's settings back."""

from __future__ import annotations

import pytest
import torch

from fedsub.engine.execution import Execution
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.numerics import float32
from fedsub.numerics.float32 import ieee_float32

from .test_backends import run


def settings() -> list:
    return [getattr(owner, name) for owner, name, _ in float32._switches()]


def test_every_switch_is_ieee_inside_and_restored_after_even_on_an_error():
    before = settings()
    tf32 = ["tf32" if isinstance(v, str) else True for v in before]
    for (owner, name, _), value in zip(float32._switches(), tf32, strict=True):
        setattr(owner, name, value)
    try:
        try:
            with ieee_float32():
                assert settings() == [ieee for _, _, ieee in float32._switches()]
                raise KeyError("stop")
        except KeyError:
            pass
        assert settings() == tf32
    finally:
        for (owner, name, _), value in zip(float32._switches(), before, strict=True):
            setattr(owner, name, value)


def test_the_cudnn_convolution_switch_is_among_them():
    """The one PyTorch leaves on by default (the H200 finding)."""
    owners = [(owner, name) for owner, name, _ in float32._switches()]
    cudnn = torch.backends.cudnn
    assert (getattr(cudnn, "conv", cudnn), "fp32_precision") in owners or (
        cudnn,
        "allow_tf32",
    ) in owners


def test_a_training_run_computes_in_ieee_float32_and_gives_the_settings_back():
    before = settings()
    tf32 = ["tf32" if isinstance(v, str) else True for v in before]
    for (owner, name, _), value in zip(float32._switches(), tf32, strict=True):
        setattr(owner, name, value)
    inside: list[list] = []
    try:
        execution = Execution(dtype=torch.float64)
        schedule = Schedule(2, 3, LocalWork(1, 2, ClientStep(0.1)), seed=0, execution=execution)
        run("synthetic", "fedavg", schedule, on_round=lambda r: inside.append(settings()))
        after = settings()
    finally:
        for (owner, name, _), value in zip(float32._switches(), before, strict=True):
            setattr(owner, name, value)
    assert inside == [[ieee for _, _, ieee in float32._switches()]] * 2
    assert after == tf32


@pytest.mark.usefixtures("flower_task_identity")
def test_a_flower_node_trains_in_ieee_float32(monkeypatch):
    """A Flower node's local steps (flower/client_app.answer_train) run under it too."""
    from fedsub.flower import client_app

    from .test_flower_private_download import BASE, _first_round

    real, inside = client_app.train_submodel, []

    def watched(*args, **kwargs):
        inside.append(settings())
        return real(*args, **kwargs)

    monkeypatch.setattr(client_app, "train_submodel", watched)
    before = settings()
    tf32 = ["tf32" if isinstance(v, str) else True for v in before]
    for (owner, name, _), value in zip(float32._switches(), tf32, strict=True):
        setattr(owner, name, value)
    try:
        plain = tuple(o for o in BASE if "randomness" not in o)  # a no-op at level none
        _first_round((*plain, "privacy.level='none'"), set())
        after = settings()
    finally:
        for (owner, name, _), value in zip(float32._switches(), before, strict=True):
            setattr(owner, name, value)
    assert inside and all(s == [ieee for _, _, ieee in float32._switches()] for s in inside)
    assert after == tf32
