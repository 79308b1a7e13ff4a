"""Runtimes declare what they support (algorithms/runtimes.py); the algorithm layer asks for a
capability, and a refusal names the runtime and the capability it lacks."""

from __future__ import annotations

import pytest

from fedsub.algorithms.registry import PRESETS, check_combination
from fedsub.algorithms.runtimes import CAPABILITIES, Runtime
from fedsub.engine.runtime import IN_PROCESS
from fedsub.errors import ConfigError
from fedsub.flower.runtime import FLOWER


def test_the_in_process_engine_runs_every_preset_and_setting():
    assert IN_PROCESS.supports == frozenset(CAPABILITIES)
    for name, preset in PRESETS.items():
        check_combination(name, preset.recipe, runtime=IN_PROCESS)


@pytest.mark.parametrize(
    ("name", "capability", "because"),
    [
        ("scaffold", "client-state", "its client piece 'scaffold' keeps per-client state"),
        ("central-sgd", "pooled-data", "its aggregation 'central' pools the data"),
    ],
)
def test_flower_refuses_a_piece_by_the_capability_it_lacks(name, capability, because):
    with pytest.raises(ConfigError) as error:
        check_combination(name, PRESETS[name].recipe, runtime=FLOWER)
    message = str(error.value)
    assert message.startswith(f"algorithm {name!r} cannot run on Flower: {because}")
    assert f"(capability {capability!r}), which Flower does not support" in message


def test_a_runtime_without_a_capability_is_named_in_the_refusal():
    bare = Runtime("a bare runtime", frozenset({"client-state"}))
    recipe = PRESETS["fedsubavg"].recipe
    check_combination("fedsubavg", recipe, runtime=bare, privacy="heat")  # no capability needed
    with pytest.raises(ConfigError, match=r"privacy\.level = 'full' cannot run on a bare runtime"):
        check_combination("fedsubavg", recipe, runtime=bare, privacy="full")
    with pytest.raises(ConfigError, match="'masking'"):
        check_combination("fedsubavg", recipe, runtime=bare, masking="static")
    check_combination("fedsubavg", recipe, runtime=FLOWER, privacy="full")  # Flower has it
