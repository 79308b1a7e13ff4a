"""File loaders fed random bytes and random lines raise only DataError, with a message."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsub.data.images import FILES as IDX_FILES
from fedsub.data.images import ImageOptions
from fedsub.data.images import load as load_images
from fedsub.data.movielens import MovieLensOptions, load
from fedsub.errors import DataError

from .test_images import write_image_set
from .test_movielens import write_1m, write_100k

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MEMBERS = {
    "movielens-100k": (write_100k, ["u.data", "u.user", "u.item"]),
    "movielens-1m": (write_1m, ["ratings.dat", "users.dat", "movies.dat"]),
}
LINE = st.one_of(
    st.text(max_size=40),
    st.lists(
        st.one_of(st.integers(-5, 10**6).map(str), st.sampled_from(["M", "F", "", "x"])), max_size=6
    ).map(lambda parts: st_join(parts)),
)


def only_data_errors(call) -> None:
    """The loader either succeeds or raises fedsub's DataError with a message."""
    try:
        call()
    except DataError as error:
        assert str(error)


def st_join(parts: list[str]) -> str:
    return "|".join(parts) if len(parts) % 2 else "::".join(parts)


def try_load(name: str, member: str, data: bytes) -> None:
    writer, _ = MEMBERS[name]
    with tempfile.TemporaryDirectory() as folder:
        root = writer(Path(folder))
        (root / member).write_bytes(data)
        only_data_errors(lambda: load(name, MovieLensOptions(), str(root), seed=0))


@SETTINGS
@given(st.sampled_from(sorted(MEMBERS)), st.data(), st.binary(max_size=300))
def test_random_bytes(name, data, payload):
    member = data.draw(st.sampled_from(MEMBERS[name][1]))
    try_load(name, member, payload)


@SETTINGS
@given(st.sampled_from(sorted(MEMBERS)), st.data(), st.lists(LINE, max_size=8))
def test_random_lines(name, data, lines):
    member = data.draw(st.sampled_from(MEMBERS[name][1]))
    try_load(name, member, "\n".join(lines).encode("utf-8", "surrogatepass"))


@SETTINGS
@given(st.binary(max_size=200), st.sampled_from(sorted(IDX_FILES)))
def test_idx_loader_random_bytes(payload, member):
    with tempfile.TemporaryDirectory() as folder:
        root = write_image_set(Path(folder) / "idx", n_train=20, n_test=10, gz=False)
        (root / IDX_FILES[member]).write_bytes(payload)
        options = ImageOptions(num_clients=2, samples_per_client=5)
        only_data_errors(lambda: load_images("mnist", options, str(root), 0))


@SETTINGS
@given(
    st.one_of(
        st.binary(max_size=300),
        st.lists(LINE, max_size=8).map(
            lambda lines: ("user,clicked,city\n" + "\n".join(lines)).encode(
                "utf-8", "surrogatepass"
            )
        ),
    )
)
def test_table_loader_random_input(payload):
    from fedsub.data.table import TableOptions
    from fedsub.data.table import load as load_table

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.csv"
        path.write_bytes(payload)
        options = TableOptions(client_column="user", label_column="clicked", features=["city"])
        only_data_errors(lambda: load_table(options, str(path), 0))


@SETTINGS
@given(
    st.one_of(
        st.binary(max_size=300),
        st.lists(LINE, max_size=8).map(lambda lines: "\n".join(lines).encode("latin-1", "replace")),
    ),
    st.booleans(),
)
def test_sent140_random_input(payload, as_json):
    from fedsub.data.sent140 import Sent140Options
    from fedsub.data.sent140 import load as load_sent140

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / ("t.json" if as_json else "t.csv")
        path.write_bytes(payload)
        only_data_errors(lambda: load_sent140(Sent140Options(min_samples=1), str(path), 0))
