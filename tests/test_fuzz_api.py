"""The Python API fed generated wrong types, ranges, shapes and encodings, one argument at a
time, as the CLI is fed in the other test_fuzz_* files: every call ends in a fedsub error
(with a message) or a run, never a raw exception from inside, and leaves the user's files as
they were (a failed call writes nothing)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

import fedsub
from fedsub import config as config_lib
from fedsub import moved_keys
from fedsub.config import DpConfig, EvalConfig, TrainConfig, inert_keys, toml_value
from fedsub.data.table import TableOptions
from fedsub.errors import FedsubError
from fedsub.keys import flat_values, key_names, section_fields
from fedsub.moved_keys import MOVED

from .test_module_contract import UNTRAINABLE, ragged_data

FAST = settings(
    max_examples=int(os.environ.get("FEDSUB_FUZZ_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
SMALL = {"rounds": 1, "clients_per_round": 2, "local_steps": 1, "batch_size": 2, "every": 1}
# keys whose large values are long, correct runs (not mistakes): given small values only
DURATIONS = {"rounds", "local_steps", "train_loss_samples", "checkpoint_every", "every"}

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([2**31, 2**63, -(2**63) - 1, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.text(max_size=6),
    st.sampled_from(["\ufeffitem", "item\x00", "fédavg", "", " ", "fedavg", "float64", "host"]),
    st.binary(max_size=4),
    st.just(np.int64(2)),
    st.just(np.float32(0.5)),
    st.just(np.array([1, 2])),
    st.just(object()),
    st.just(len),
)
WRONG = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.tuples(SCALARS),
    st.dictionaries(st.text(max_size=4), SCALARS, max_size=2),
)


# valid or nearly valid values of the [train] / [eval] keys (compile "on" left out: a correct
# but slow run)
NEAR = st.sampled_from(
    [
        0,
        1,
        2,
        0.5,
        1.0,
        0.0,
        True,
        "none",
        "static",
        "rolling",
        "host",
        "device",
        "float64",
        "sequential",
        "cuda",
        "auto",
        "full",
        "heat",
        "download",
        "secagg",
        "sketch",
        "randomized-response",
        "exponential",
        "clients",
        "central-min",
        [1.0, 0.5],
        [0.5],
        [],
        ["fedavg"],
        {"fedprox": {"mu": 0.1}},
    ]
)


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.item = nn.EmbeddingBag(10, 2, mode="sum")
        self.out = nn.Linear(2, 1)

    def forward(self, batch: Any) -> torch.Tensor:
        return self.out(self.item(*batch.ids["item"])).squeeze(-1)


def tiny_clients() -> list:
    return [fedsub.samples([0, 1, 1, 0], ids={"item": [[k, 1], [2], [], [3, 9]]}) for k in range(4)]


DATA = fedsub.from_clients(tiny_clients(), table_rows={"item": 10})


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def ends_well(call: Callable[[], Any], folder: Path, writes: bool = False) -> None:
    """``call`` raises a FedsubError with a message, or returns; the files in ``folder``
    stay as they were (new files only when it returned and ``writes``)."""
    before = snapshot(folder)
    try:
        call()
    except FedsubError as error:
        assert str(error).strip(), "a fedsub error without a message"
        assert snapshot(folder) == before
        return
    after = snapshot(folder)
    assert {k: v for k, v in after.items() if k in before} == before
    if not writes:
        assert after == before


@pytest.fixture
def user_folder(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("the user's file\n")
    return tmp_path


@FAST
@given(
    labels=st.one_of(WRONG, st.just([0, 1])),
    ids=st.one_of(WRONG, st.dictionaries(st.sampled_from(["item", 3, ""]), WRONG, max_size=2)),
    dense=st.one_of(st.none(), WRONG),
    where=st.one_of(st.just("samples"), WRONG),
)
def test_samples(labels, ids, dense, where, user_folder):
    ends_well(lambda: fedsub.samples(labels, ids=ids, dense=dense, where=where), user_folder)


@FAST
@given(
    argument=st.sampled_from(["clients", "test", "table_rows", "field_tables", "name"]),
    value=st.one_of(
        WRONG,
        st.dictionaries(st.sampled_from(["item", "other"]), SCALARS, max_size=2),
        st.lists(st.one_of(st.just(tiny_clients()[0]), SCALARS), max_size=3),
    ),
)
def test_from_clients(argument, value, user_folder):
    arguments: dict[str, Any] = {"clients": tiny_clients(), "table_rows": {"item": 10}}
    arguments[argument] = value
    ends_well(lambda: fedsub.from_clients(**arguments), user_folder)


@FAST
@given(
    option=st.sampled_from([f.name for f in dataclasses.fields(TableOptions)] + ["nope"]),
    value=st.one_of(WRONG, st.sampled_from(["item", "x", "user", "label", ["item", "x"]])),
    cell=st.sampled_from(["x", "\ufeffy", "z\x00", "é", "", None, math.nan, 3, ["a", "b"]]),
)
def test_from_dataframe(option, value, cell, user_folder):
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame(
        {
            "user": list("aabbccdd"),
            "item": ["x", "y", cell, "z", "x", "y", "z", "z"],
            "label": [1, 0, 0, 1, 1, 0, 1, 0],
            "x": [0.1, 0.2, 0.3, 0.1, 0.5, 0.3, 0.2, 0.1],
        }
    )
    options: dict[str, Any] = {"client_column": "user", "features": ["item"]}
    options[option] = value
    ends_well(lambda: fedsub.from_dataframe(frame, **options), user_folder)


def _options(key: str, value: Any) -> dict[str, Any]:
    if key in DURATIONS and isinstance(value, int) and not isinstance(value, bool):
        value = max(-3, min(value, 3))
    return {**SMALL, key: value}


TRAIN_KEYS = sorted(set(key_names(TrainConfig)) | set(key_names(EvalConfig)))


@FAST
@given(
    model=st.sampled_from(["sparse-lr", "module", "embedding-lr"]),
    key=st.sampled_from(
        [*TRAIN_KEYS, "tables", "model_options", "algorithm_options", "loss", "task", "nope"]
    ),
    value=st.one_of(WRONG, NEAR),
    also=st.dictionaries(st.sampled_from(TRAIN_KEYS), NEAR, max_size=2),
)
def test_train(model, key, value, also, user_folder):
    given_model: Any = Bag() if model == "module" else model
    options = {**_options(key, value), **{k: v for k, v in also.items() if k not in DURATIONS}}
    ends_well(lambda: fedsub.train(given_model, DATA, **options), user_folder)


@FAST
@given(
    argument=st.sampled_from(["model", "data", "algorithms", "algorithm_options"]),
    value=st.one_of(WRONG, st.sampled_from(["fedavg", ["fedavg", "fedavg"], ["fedprox"]])),
)
def test_compare(argument, value, user_folder):
    arguments: dict[str, Any] = {"model": "sparse-lr", "data": DATA, "algorithms": ["fedavg"]}
    arguments[argument] = value
    ends_well(lambda: fedsub.compare(**arguments, **SMALL), user_folder)


@FAST
@given(
    raw=st.one_of(
        WRONG,
        st.dictionaries(
            st.sampled_from(["train", "data", "eval", "model", "x"]), WRONG, max_size=2
        ),
        st.builds(
            lambda section, key, value: {section: {key: value}},
            st.sampled_from(["train", "eval", "data", "model"]),
            st.sampled_from(["rounds", "lr", "name", "seed", "path", "every", "num_users"]),
            WRONG,
        ),
    )
)
def test_config_from_dict(raw, user_folder):
    ends_well(lambda: fedsub.Config.from_dict(raw), user_folder)


RUN_CONFIG = {
    "train": {**{k: v for k, v in SMALL.items() if k != "every"}, "algorithms": ["fedsubavg"]},
    "data": {"num_users": 12},
}


@FAST
@given(
    argument=st.sampled_from(
        ["config", "out", "resume", "overwrite", "profile", "stop_requested", "on_round"]
    ),
    value=WRONG,
)
def test_run(argument, value, user_folder):
    arguments: dict[str, Any] = {"config": RUN_CONFIG}
    if argument == "out" and isinstance(value, str):
        value = str(user_folder / "runs" / value.replace("\x00", ""))
    arguments[argument] = value
    ends_well(lambda: fedsub.run(**arguments), user_folder, writes=argument == "out")


@FAST
@given(
    key=st.one_of(
        st.sampled_from(["train.clients_per_round", "train.lr", "data.name", "eval.every", "x.y"]),
        WRONG,
    ),
    values=st.one_of(WRONG, st.lists(SCALARS, min_size=1, max_size=2)),
)
def test_sweep(key, values, user_folder):
    base = {"train": {**RUN_CONFIG["train"], "clients_per_round": 2}, "data": {"num_users": 12}}
    if isinstance(values, list):  # small values of the time-taking keys
        values = [
            max(-3, min(v, 3)) if isinstance(v, int) and not isinstance(v, bool) else v
            for v in values
        ]
    out = user_folder / "sweep"
    ends_well(lambda: fedsub.sweep(base, key, values, out=out), user_folder, writes=True)


@FAST
@given(
    name=st.one_of(st.sampled_from(["synthetic-sparse", "synthetic-li", "table", "nope"]), WRONG),
    path=st.one_of(st.none(), WRONG),
    seed=st.one_of(st.just(0), WRONG),
    option=st.sampled_from(["num_users", "num_devices", "features", "dim", "x"]),
    value=WRONG,
)
def test_load_dataset(name, path, seed, option, value, user_folder):
    if option in ("num_users", "num_devices", "dim") and isinstance(value, int):
        value = max(-3, min(value, 30))  # a large, valid population: a long correct load

    def call() -> Any:
        return fedsub.load_dataset(name, path=path, seed=seed, **{option: value})

    ends_well(call, user_folder)


@FAST
@given(
    source=st.one_of(
        st.none(),
        WRONG,
        st.sampled_from(["[train]\nrounds = 2", "\ufeff[train]\nrounds = 2", "[train\n", "x.toml"]),
    ),
    overrides=st.one_of(
        WRONG, st.lists(st.sampled_from(["train.rounds=2", "train.lr=-1", "x", "=", ""]))
    ),
)
def test_config_from_toml(source, overrides, user_folder):
    ends_well(lambda: fedsub.Config.from_toml(source, overrides), user_folder)


class Partitions:
    """A stand-in for a flwr_datasets partitioner: its partitions are DataFrames."""

    def __init__(self, count: Any, part: Any) -> None:
        self.num_partitions, self.part = count, part

    def load_partition(self, partition_id: int) -> Any:
        return self.part


@FAST
@given(
    count=st.one_of(st.just(2), WRONG),
    part=st.one_of(st.just("frame"), WRONG),
    argument=st.sampled_from(["test", "name", "seed", "features", "client_column"]),
    value=WRONG,
)
def test_from_partitioner(count, part, argument, value, user_folder):
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"item": list("abcd"), "label": [0, 1, 1, 0]})
    if isinstance(count, int) and not isinstance(count, bool):
        count = min(count, 5)  # many partitions of a real partitioner: a long, correct load
    partitioner = Partitions(count, frame if isinstance(part, str) and part == "frame" else part)
    options: dict[str, Any] = {"features": ["item"], argument: value}
    ends_well(lambda: fedsub.from_partitioner(partitioner, **options), user_folder)


# --- the classes of issue 48: a key under two names, options that do nothing, "none" for unset,
# modules fedsub cannot train, model files that are not finite --------------------------------


def refused(call: Callable[[], Any], folder: Path) -> str:
    """The message of the FedsubError ``call`` must raise, the files in ``folder`` as they
    were."""
    before = snapshot(folder)
    with pytest.raises(FedsubError) as caught:
        call()
    assert snapshot(folder) == before
    return str(caught.value)


NEW_DEFAULT = {
    old: getattr(fedsub.Config.from_dict({}).__getattribute__(section), key)
    for old, (section, key) in MOVED.items()
}


@FAST
@given(
    old=st.sampled_from(sorted(MOVED)),
    source=st.sampled_from(["dict", "run", "text", "overrides", "overrides reversed"]),
)
def test_a_key_under_its_old_and_new_name_is_refused_naming_both(old, source, user_folder):
    """Whatever the source (a dict, fedsub.run's dict, TOML text, --set texts in either
    order), ``train.<old>`` and its new place given together are one error naming both,
    never the last one silently winning."""
    section, key = MOVED[old]
    value = NEW_DEFAULT[old]  # a valid value: only the two names are wrong
    text = toml_value(value)
    if source in ("dict", "run"):
        raw = {"train": {old: value}, section: {key: value}}
        call = (lambda: fedsub.Config.from_dict(raw)) if source == "dict" else (
            lambda: fedsub.run(raw))  # fmt: skip
    elif source == "text":
        both = f"[train]\n{old} = {text}\n[{section}]\n{key} = {text}\n"
        call = lambda: fedsub.Config.from_toml(both)  # noqa: E731
    else:
        sets = [f"train.{old}={text}", f"{section}.{key}={text}"]
        sets = sets[::-1] if source == "overrides reversed" else sets
        call = lambda: fedsub.Config.from_toml(None, sets)  # noqa: E731
    error = refused(call, user_folder)
    assert f"train.{old}" in error and f"{section}.{key}" in error, error


def _inert_cases() -> list[tuple[str, Any]]:
    """(keyword argument, a valid value other than its default) for every [masking] /
    [privacy] key the default config leaves unused."""
    default = fedsub.Config.from_dict({})
    keyword = {moved_keys.new_name(old): old for old in MOVED}
    cases = []
    for dotted, _ in inert_keys(default):
        if dotted not in keyword:  # no keyword argument of its own (privacy.randomness: config=)
            continue
        section, key = dotted.split(".")
        value = getattr(getattr(default, section), key)
        field = config_lib.SECTIONS[section].__dataclass_fields__[key]  # type: ignore[union-attr]
        if "choices" in field.metadata:
            other: Any = next(c for c in field.metadata["choices"]() if c != value)
        elif isinstance(value, list):
            other = [0.5] if key == "capacities" else [1.0] * 5
        elif isinstance(value, float):
            other = value / 2
        else:
            other = value + 1
        cases.append((keyword[dotted], other))
    return cases


@FAST
@given(case=st.sampled_from(_inert_cases()), model=st.sampled_from(["sparse-lr", "module"]))
def test_an_option_that_does_nothing_is_refused_saying_why(case, model, user_folder):
    keyword, value = case
    given_model: Any = Bag() if model == "module" else model
    error = refused(
        lambda: fedsub.train(given_model, DATA, **SMALL, **{keyword: value}), user_folder
    )
    assert re.match(rf"^{keyword} = .* does nothing here: ", error), error
    assert error.count(keyword) >= 2  # named, and what to remove


OPTIONAL_KEYS = [
    (section, f.name)
    for section in ("eval", "dp")
    for _, f in section_fields(config_lib.SECTIONS[section])  # type: ignore[arg-type]
    if f.default is None
]


@FAST
@given(
    place=st.sampled_from(OPTIONAL_KEYS),
    spelling=st.sampled_from(["none", "None", "NONE", " none ", "null"]),
    source=st.sampled_from(["text", "dict"]),
)
def test_none_as_a_string_for_an_optional_key_says_how_to_leave_it_unset(
    place, spelling, source, user_folder
):
    section, key = place
    raw = {section: {key: spelling}}
    text = f"[{section}]\n{key} = {toml_value(spelling)}\n"
    call = (lambda: fedsub.Config.from_dict(raw)) if source == "dict" else (
        lambda: fedsub.Config.from_toml(text))  # fmt: skip
    error = refused(call, user_folder)
    assert re.search(r"the string 'none' is not 'not set'.*leave the key out", error), error


@FAST
@given(
    case=st.sampled_from(UNTRAINABLE),
    options=st.dictionaries(st.sampled_from(["backend", "dtype", "lr"]),
                            st.sampled_from(["sequential", "float64", 0.5]), max_size=2),
)  # fmt: skip
def test_a_module_fedsub_cannot_train_is_one_error_whatever_the_options(case, options, user_folder):
    make, expected = case
    options = {k: v for k, v in options.items() if (k == "lr") == isinstance(v, float)}
    error = refused(lambda: fedsub.train(make(), ragged_data(), **SMALL, **options), user_folder)
    assert re.search(expected, error), error


@FAST
@given(
    tensor=st.sampled_from(["table.item", "dense.out.weight", "dense.out.bias"]),
    bad=st.sampled_from([math.nan, math.inf, -math.inf]),
    where=st.integers(min_value=0, max_value=100),
)
def test_a_model_file_with_nan_or_inf_is_refused_naming_the_tensor(tensor, bad, where, user_folder):
    module = Bag()
    start = fedsub.train(module, DATA, **SMALL).params.state_dict()
    spoiled = {n: v.clone() for n, v in start.items()}
    flat = spoiled[tensor].view(-1)
    flat[where % flat.numel()] = bad
    path = user_folder / "start.safetensors"
    save_file(spoiled, str(path))
    error = refused(lambda: fedsub.train(Bag(), DATA, initial_model=path, **SMALL), user_folder)
    assert f"holds NaN or Inf values in tensor(s) '{tensor}'" in error, error


DP_TABLES = st.dictionaries(
    st.sampled_from(
        [
            "mechanism",
            "noise_multiplier",
            "target_epsilon",
            "delta",
            "clip",
            "selection_threshold",
            "epsilon_budget",
            "weight_cap",
        ]
    ),
    st.one_of(
        st.sampled_from(["gaussian", "none", 1e9, 1e6, 1e-6, 1e-30, 0.5, 1.0, 4.0, 0.0, -1.0]),
        SCALARS,
    ),
    max_size=4,
)


@FAST
@given(dp=st.one_of(DP_TABLES, WRONG))
def test_train_with_dp(dp, user_folder):
    """dp={...} as a user would try it: a run (under [dp] only with dp.mechanism set: never a
    silent non-DP run) or a fedsub error, never a raw one from the accountant."""

    def call() -> None:
        result = fedsub.train("sparse-lr", DATA, algorithm="fedavg", dp=dp, **SMALL)
        private = isinstance(dp, dict) and dp.get("mechanism") == "gaussian"
        assert private == ("epsilon" in result.history[-1]), (dp, result.history[-1])
        if isinstance(dp, dict) and not private:  # other keys without it: refused
            defaults = flat_values(DpConfig())
            assert all(k == "mechanism" or v in (None, defaults[k]) for k, v in dp.items()), dp

    ends_well(call, user_folder)
