"""Every registered model's optional capabilities (the Protocols in models/base.py): which it
claims (and those of users' nn.Modules wrapped by models/torch_module.py).
test_conformance_models.py checks that the claimed ones work (cohort head against vmap,
slicing round trips); closed-form gradients are checked against autograd in test_backends.py
(test_sparse_lr_closed_form_gradients_equal_autograd), and the sequential fallback of a model
declaring ``batchable = False`` there too."""

from __future__ import annotations

import dataclasses

import pytest

from fedsub.models.base import (
    ClosedFormGradients,
    CohortHead,
    DeclaresBatchable,
    DeclaresCapturable,
    EvalBatch,
    LowRankWeights,
    PackedFeatures,
    SliceableModel,
    has_capability,
    is_batchable,
)
from fedsub.models.registry import CAPABILITIES as CAPABILITY_NAMES
from fedsub.models.registry import build_model, model_names, model_spec

from .test_resume_matrix import OPTIONS, SMALL_WIDTHS, dataset_for, smaller
from .torch_modules import wrapped, wrapped_cases

CAPABILITIES = (
    CohortHead,
    ClosedFormGradients,
    DeclaresBatchable,
    DeclaresCapturable,
    EvalBatch,
    LowRankWeights,
    PackedFeatures,
    SliceableModel,
)
EXPECTED = {
    "sparse-lr": {CohortHead, ClosedFormGradients},
    "embedding-lr": {CohortHead},
    "softmax-regression": {CohortHead},
    "linear-regression": {CohortHead},
    # the history packed (not captured: execution.compile), the output MLP low-rank in a cohort,
    # evaluated in the authors' test batches of 1,024 (Dice's batch statistics)
    "din": {CohortHead, PackedFeatures, LowRankWeights, EvalBatch},
    "lstm": {CohortHead, DeclaresCapturable},
    "cnn": {SliceableModel},
    "mlp": {SliceableModel},
    "resnet18": {SliceableModel, EvalBatch},
    "torch-module": {DeclaresBatchable},  # a user's module (tests/torch_modules.py: AnyData)
}
# users' nn.Modules wrapped by fedsub.models.torch_module (checked like the registered models)
WRAPPED = {name: {DeclaresBatchable} for name in wrapped_cases()}
CHECKED = [*model_names(), *WRAPPED]  # what the conformance suite checks


def built(name: str, folder: str):
    if name in WRAPPED:
        return wrapped(name)
    dataset, _ = dataset_for(name, folder)
    options = {**OPTIONS, "widths": SMALL_WIDTHS.get(name, [])}
    model = smaller(build_model(name, dataset, options), name)
    return model, dataset


def test_every_registered_model_has_its_capabilities_listed_here():
    assert sorted(EXPECTED) == model_names()


def test_the_config_check_for_masking_names_exactly_the_sliceable_models():
    """config.py refuses masking from the model's spec (before any data is loaded): the specs
    that say sliceable must be the models that really satisfy SliceableModel."""
    sliceable = {n for n in model_names() if model_spec(n).sliceable}
    assert sliceable == {n for n, caps in EXPECTED.items() if SliceableModel in caps}


@pytest.mark.parametrize("name", model_names())
def test_a_specs_capabilities_read_from_its_class_are_its_models(name, tmp_path_factory):
    """ModelSpec.capabilities reads the Protocols off the class (no model is built for
    `fedsub list models`): they must be those of a built model, and the builder must build
    that class."""
    model, _ = built(name, str(tmp_path_factory.getbasetemp()))
    spec = model_spec(name)
    assert isinstance(model, spec.model_class)
    by_name = {CAPABILITY_NAMES[c] for c in spec.capabilities()}
    assert by_name == {c for c in CAPABILITIES if isinstance(model, c)} == EXPECTED[name]


@pytest.mark.parametrize("name", CHECKED)
def test_each_model_satisfies_exactly_its_protocols(name, tmp_path_factory):
    model, _ = built(name, str(tmp_path_factory.getbasetemp()))
    expected = {**EXPECTED, **WRAPPED}[name]
    assert {c for c in CAPABILITIES if isinstance(model, c)} == expected
    for _ in range(2):  # has_capability, the engine's check: the same, asked and remembered
        assert {c for c in CAPABILITIES if has_capability(model, c)} == expected
    assert is_batchable(model)
    if isinstance(model, DeclaresCapturable):
        assert model.capturable is False  # the only reason to declare it


def test_eval_batch_is_a_positive_sample_count(tmp_path_factory):
    for name, caps in EXPECTED.items():
        if EvalBatch in caps:
            model, _ = built(name, str(tmp_path_factory.getbasetemp()))
            assert isinstance(model.eval_batch, int) and model.eval_batch > 0


def test_batchable_unless_a_model_declares_otherwise():
    from .conftest import SquaredDistance

    @dataclasses.dataclass(frozen=True)
    class Declares(SquaredDistance):
        batchable: bool = True

    assert is_batchable(SquaredDistance(rows=3, w0=1.0))
    assert is_batchable(Declares(rows=3, w0=1.0))
    assert not is_batchable(Declares(rows=3, w0=1.0, batchable=False))


def test_masked_training_of_a_model_that_cannot_be_sliced_says_so(tmp_path_factory):
    from fedsub.engine.cohort_job import CohortJob
    from fedsub.engine.features import masking as masked

    model, _ = built("sparse-lr", str(tmp_path_factory.getbasetemp()))
    with pytest.raises(TypeError, match="SparseLogisticRegression is not one"):
        masked.run_cohort(CohortJob(model, *([None] * 7)), None, None)


def test_capacities_too_small_for_a_sliceable_models_layers_are_warned_about(
    tmp_path_factory, caplog
):
    from fedsub.config import parse
    from fedsub.runs.checks import _check_capacities

    config = parse({"model": {"name": "cnn"}, "train": {"masking": "static", "capacities": [0.1]}})
    model, _ = built("cnn", str(tmp_path_factory.getbasetemp()))  # 2 and 3 channels
    with caplog.at_level("WARNING", logger="fedsub"):
        _check_capacities(config, model, num_clients=10)
    assert "masking.capacities entry 0.1 keeps less than one of the 2 channels" in caplog.text
