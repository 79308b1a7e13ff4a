"""The config parser fed random bytes, random lines and random overrides raises only
ConfigError (with a message), never an unrelated exception."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsub import config as config_lib
from fedsub.errors import ConfigError
from fedsub.keys import key_names
from fedsub.moved_keys import MOVED

KEYS = {
    "data": ["name", "path", "seed", "num_users", "num_items", "zipf_exponent", "alpha"],
    "model": ["name", "init_std"],
    "train": [
        "algorithms",
        "rounds",
        "lr",
        "heat",
        "dtype",
        "backend",
        "lr_schedule",
        "clip_norm",
        "checkpoint_every",
        "max_update_norm",
        "masking",  # keys that moved out of [train] (moved_keys.py): still read, at their place
        "privacy",
    ],
    "execution": ["dtype", "backend", "threads", "device"],
    "privacy": ["level", "heat_source", "download_keep"],
    "masking": ["scheme", "capacities", "average"],
    "eval": ["every", "target_train_loss", "target_test_auc", "gradient_norms"],
    "algorithms.fedprox": ["mu", "lr"],
    "algorithms.fedadam": ["server_lr", "beta1", "tau"],
}
VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(
        lambda f: (
            "nan"
            if f != f
            else ("inf" if f == float("inf") else "-inf" if f == float("-inf") else repr(f))
        )
    ),
    st.text(max_size=12).map(lambda t: '"' + t.replace("\\", "").replace('"', "") + '"'),
    st.sampled_from(
        [
            "true",
            "false",
            "[]",
            '["fedavg"]',
            '["fedavg@scheme2", 3]',
            "{}",
            '"central-min"',
            '"synthetic-li"',
            '"sequential"',
            "[1, 2]",
        ]
    ),
)
LINES = st.one_of(
    st.builds(lambda s: f"[{s}]", st.sampled_from([*KEYS, "trian", "data.x", "algorithms"])),
    st.builds(
        lambda section, value, data: f"{data.draw(st.sampled_from(KEYS[section]))} = {value}",
        st.sampled_from(list(KEYS)),
        VALUES,
        st.data(),
    ),
    st.text(max_size=30),
)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def load_text(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fuzz.toml"
        path.write_bytes(data)
        try:
            config_lib.load(path)
        except ConfigError as error:
            assert str(error)


@SETTINGS
@given(st.binary(max_size=400))
def test_random_bytes(data):
    load_text(data)


@SETTINGS
@given(st.lists(LINES, max_size=12))
def test_random_lines(lines):
    load_text("\n".join(lines).encode("utf-8", "surrogatepass"))


@SETTINGS
@given(
    st.lists(
        st.builds(
            lambda k, v: f"{k}={v}",
            st.sampled_from(
                [f"{s}.{k}" for s, ks in KEYS.items() for k in ks] + ["rounds", "x.y", "train."]
            ),
            VALUES,
        ),
        max_size=4,
    )
)
def test_random_overrides(overrides):
    try:
        config_lib.load(None, overrides)
    except ConfigError as error:
        assert str(error)


# Every config key, random values through `--set` or a TOML file, in-process `fedsub compare`
# on tiny data: a run (exit 0) or only `fedsub: ...` lines ending in an error (exit 2), never
# a traceback. Sizes are kept small so that every accepted config trains in well under 1 s.
def _all_keys() -> list[str]:
    import dataclasses

    from fedsub.algorithms.registry import algorithm_names, options_class
    from fedsub.data.registry import DATASETS

    keys = [
        f"{section}.{key}"
        for section, cls in config_lib.SECTIONS.items()
        if cls is not None
        for key in key_names(cls)
    ]
    for name in ("synthetic-sparse", "synthetic-li"):
        keys += [f"data.{f.name}" for f in dataclasses.fields(DATASETS[name].options)]
    for name in algorithm_names():
        keys += [f"algorithms.{name}.{f.name}" for f in dataclasses.fields(options_class(name))]
    keys += [f"train.{old}" for old in MOVED]  # the old names of moved keys: still read
    return sorted(set(keys))


ALL_KEYS = _all_keys()
TINY_RUN = [
    "data.num_users=12",
    "data.num_items=10",
    "data.mean_samples_per_user=6",
    "train.rounds=1",
    "train.clients_per_round=3",
    "train.local_steps=1",
    "train.batch_size=2",
    "privacy.secagg_group=3",
    "train.checkpoint_every=0",
    "eval.train_loss_samples=20",
    'train.algorithms=["fedavg", "fedsubavg"]',
]
SMALL_VALUES = st.one_of(
    st.integers(min_value=-2, max_value=4).map(str),
    st.sampled_from(["0.0", "0.5", "1.0", "1e-9", "-1.5", "1e30", "nan", "inf", "2**70"]),
    st.sampled_from([str(2**63), str(2**62), "true", "false", "[]", "[2, 1]", "{}", '""']),
    st.sampled_from(
        [
            '"synthetic-li"',
            '"table"',
            '"din"',
            '"mlp"',
            '"cnn"',
            '"lstm"',
            '"embedding-lr"',
            '"softmax-regression"',
            '"secagg"',
            '"sketch"',
            '"randomized-response"',
            '"static"',
            '"central-min"',
            '"clients"',
            '"sequential"',
            '"float64"',
            '"exponential"',
            '["scaffold", "fedprox@scheme1"]',
            '["central-sgd"]',
            '["fedadam", "scaffold-approx"]',
        ]
    ),
    st.sampled_from(["none", "None"]),  # unset: the key's built-in default
    st.text(max_size=6).map(lambda t: t.replace("\n", " ")),
)
RUN_SETTINGS = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _run_main(argv: list[str], capsys, out: Path, named: list[str]) -> None:
    """The run (exit 0; exit 1 when it diverged, its outputs written), or one error (exit 2)
    that names one of ``named`` (the keys, the values, the file); on an error the output
    folder is as it was (empty or absent)."""
    from fedsub.cli import main

    code = main(argv)  # any exception other than FedsubError escapes: a traceback
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code in (0, 1, 2), (argv, code, err)
    if code == 1:
        assert "diverged at round" in lines[-1] and (out / "summary.json").exists(), err
    if code == 2:
        assert lines and lines[-1].startswith("fedsub: error: "), err
        assert all(line.startswith("fedsub: ") for line in lines), err
        assert any(n in lines[-1] for n in named), (named, lines[-1])
        assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))


def _named(overrides: list[tuple[str, str]], *more: str) -> list[str]:
    """What an error may name: a key (as section.key or its last part) or a value given."""
    names = [k for k, _ in overrides] + [k.rsplit(".", 1)[-1] for k, _ in overrides]
    return [*names, *(v.strip() for _, v in overrides if len(v.strip()) > 1), *more]


@RUN_SETTINGS
@given(st.lists(st.tuples(st.sampled_from(ALL_KEYS), SMALL_VALUES), min_size=1, max_size=3))
def test_random_values_for_every_key_through_set_run_or_exit_2(capsys, overrides):
    with tempfile.TemporaryDirectory() as folder:
        sets = [*TINY_RUN, *(f"{k}={v}" for k, v in overrides)]
        out = Path(folder) / "out"
        argv = ["compare", "--quiet", "--out", str(out)]
        _run_main(argv + [a for s in sets for a in ("--set", s)], capsys, out, _named(overrides))


@RUN_SETTINGS
@given(st.lists(st.tuples(st.sampled_from(ALL_KEYS), SMALL_VALUES), min_size=1, max_size=3))
def test_random_values_for_every_key_in_a_toml_file_run_or_exit_2(capsys, overrides):
    tables: dict[str, list[str]] = {}
    for text in [*TINY_RUN, *(f"{k}={v}" for k, v in overrides)]:
        dotted, value = text.split("=", 1)
        section, key = dotted.rsplit(".", 1)
        tables.setdefault(section, []).append(f"{key} = {value}")
    body = "\n".join(f"[{s}]\n" + "\n".join(lines) for s, lines in tables.items())
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fuzz.toml"
        path.write_text(body, encoding="utf-8")
        out = Path(folder) / "out"
        argv = ["compare", str(path), "--quiet", "--out", str(out)]
        _run_main(argv, capsys, out, _named(overrides, str(path)))


NAMES = st.sampled_from(
    [
        "fedavg",
        "fedsubavg",
        "fedavgg",
        "fedavg@scheme1",
        "fedavg@bogus",
        "central-sgd@scheme1",
        "scaffold",
        "mine",
        "mine@scheme2",
        "",
        " ",
        "fedprox,",
    ]
)
COMPOSED = '\n[algorithms.mine]\naggregation = "fedsubavg"\nclient = ["prox"]\n'


@RUN_SETTINGS
@given(names=st.lists(NAMES, min_size=1, max_size=3), flag=st.sampled_from(["run", "compare"]))
def test_an_error_from_algorithm_flags_names_the_flag(capsys, names, flag):
    """The reported bug: errors of `--algorithm X` read as if the user had typed
    `--set train.algorithms=[...]`, and `--algorithms ""` silently ran the config's."""
    from fedsub.cli import main

    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "c.toml"
        tables = {}
        for text in TINY_RUN:
            dotted, value = text.split("=", 1)
            section, key = dotted.rsplit(".", 1)
            tables.setdefault(section, []).append(f"{key} = {value}")
        body = "\n".join(f"[{s}]\n" + "\n".join(lines) for s, lines in tables.items())
        config.write_text(body + COMPOSED, encoding="utf-8")
        text = names[0] if flag == "run" else ",".join(names)
        option = "--algorithm" if flag == "run" else "--algorithms"
        argv = [flag, str(config), option, text, "--quiet", "--out", str(Path(folder) / "o")]
        code = main(argv)
        err = capsys.readouterr().err
        assert code in (0, 2), err
        if any(not name.strip() for name in text.split(",")):
            assert code == 2, f"{option} {text!r} ran"  # an empty name is never ignored
        if code == 0:
            return
        line = err.strip().splitlines()[-1]
        assert line.startswith(f"fedsub: error: {option} "), line


# [dp] as a new user would try it: keys without the mechanism, extreme multipliers, targets,
# deltas, clips and thresholds; every run ends in exit 0 / 1 or one error naming a key or value
DP_KEYS = [
    "dp.mechanism",
    "dp.noise_multiplier",
    "dp.target_epsilon",
    "dp.delta",
    "dp.clip",
    "dp.selection_threshold",
    "dp.epsilon_budget",
    "dp.adaptive_clip",
    "dp.weight_cap",
    "train.max_update_norm",
]
DP_VALUES = st.sampled_from(
    [
        '"gaussian"',
        '"none"',
        "1e9",
        "1e6",
        "1e-6",
        "1e-30",
        "0.5",
        "1.0",
        "4",
        "0.1",
        "true",
        "None",
        "nan",
        "-1",
    ]
)


@RUN_SETTINGS
@given(
    st.lists(st.tuples(st.sampled_from(DP_KEYS), DP_VALUES), min_size=1, max_size=4),
    st.booleans(),
)
def test_random_dp_settings_run_or_exit_2_naming_a_key(capsys, overrides, gaussian):
    """No silent non-DP and no raw error from the accountant: a dp key without the mechanism is
    an error naming dp.mechanism; any other mistake names its key or value."""
    with tempfile.TemporaryDirectory() as folder:
        first = ["dp.mechanism='gaussian'"] if gaussian else []
        sets = [*TINY_RUN, *first, *(f"{k}={v}" for k, v in overrides)]
        out = Path(folder) / "out"
        argv = ["compare", "--quiet", "--out", str(out)]
        argv += [a for s in sets for a in ("--set", s)]
        _run_main(argv, capsys, out, _named(overrides, "dp.mechanism"))
