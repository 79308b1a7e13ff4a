"""Malformed table files through the CLI: a loaded dataset or `fedsub: error:` lines and exit
code 2, never a traceback."""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsub.cli import main

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
COLUMNS = ["user", "clicked", "city", "tags", "price"]
GOOD = {  # values a valid file holds
    "user": ["u1", "u2", "u3"],
    "clicked": ["0", "1"],
    "city": ["paris", "lyon", ""],
    "tags": ["a|b", "b", ""],
    "price": ["1", "2.5", "50"],
}
BAD = {  # and degenerate ones
    "user": ["", " "],
    "clicked": ["1.0", "2", "x", "", "nan"],
    "city": ["a,b", "|"],
    "tags": ["|", "a||"],
    "price": ["", "nan", "inf", "-0", "1e39", "3e38", "-3e38", "x"],
}
CONFIG = """
[data]
name = "table"
path = "{path}"
client_column = "user"
label_column = "clicked"
features = ["city", "tags"]
multi_hot = ["tags"]
numeric = ["price"]
test_fraction = 0.3
"""


@st.composite
def table_text(draw) -> str:
    """A CSV near the expected layout: columns may be missing, doubled or reordered; values
    from each column's good and bad cases; rows may have a wrong number of fields."""
    header = draw(st.permutations(COLUMNS))
    if draw(st.integers(0, 4)) == 0:  # a column missing or doubled
        header = draw(st.lists(st.sampled_from(COLUMNS), min_size=1, max_size=6))
    bad_rate = draw(st.sampled_from([0, 20, 5]))  # one value in this many is bad; 0: none
    rows = []
    for _ in range(draw(st.integers(0, 14))):
        row = [
            draw(
                st.sampled_from(
                    BAD[c] if bad_rate and draw(st.integers(1, bad_rate)) == 1 else GOOD[c]
                )
            )
            for c in header
        ]
        if draw(st.integers(0, 19)) == 0:
            row = row[:-1]
        rows.append(",".join(f'"{v}"' if "," in v else v for v in row))
    return "\n".join([",".join(header), *rows]) + "\n"


def run_stats(payload: bytes, suffix: str = ".csv") -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"t{suffix}"
        path.write_bytes(payload)
        config = Path(folder) / "c.toml"
        config.write_text(CONFIG.replace("{path}", str(path)))
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(["data", "stats", str(config)])
        return code, err.getvalue()


def assert_clean(code: int, err: str) -> None:
    assert "Traceback" not in err
    if code != 0:
        assert code == 2
        errors = [line for line in err.splitlines() if line.startswith("fedsub: error: ")]
        assert errors and len(errors[0]) > len("fedsub: error: ")


@SETTINGS
@given(table_text())
def test_malformed_csv_gives_only_fedsub_errors(text):
    assert_clean(*run_stats(text.encode()))


@SETTINGS
@given(st.binary(max_size=200), st.sampled_from([".csv", ".parquet"]))
def test_random_bytes_as_csv_or_parquet_give_only_fedsub_errors(payload, suffix):
    assert_clean(*run_stats(payload, suffix))
