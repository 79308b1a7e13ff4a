"""The config parser fed random bytes, random lines and random overrides raises only
ConfigError (with a message), never an unrelated exception."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsub import config as config_lib
from fedsub.errors import ConfigError

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
    ],
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
