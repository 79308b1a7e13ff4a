"""Generated table files, as people save them: the same table written as CSV in every accepted
encoding (UTF-8 with and without a byte-order mark, UTF-16, any codec named in data.encoding),
with any quoting, and as Parquet (a multi-hot column as a list column or as joined text, the
label as 0/1, 0.0/1.0 or booleans) loads to the same dataset; one bad cell or byte is refused
through the CLI (exit 2, one `fedsub: error:` line) naming the file, the line (or row), the
column and the value, or the byte's offset, and never with a traceback."""

from __future__ import annotations

import codecs
import contextlib
import csv
import dataclasses
import io
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fedsub.cli import main
from fedsub.data.table import TableOptions, load

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CITIES = ["paris", "lyon", "nîmes", "köln", "o'hare", 'say "hi"', "a,b", "x y", "é"]
TAGS = ["sport", "news", "ça", "2", "t t"]
OPTIONS = TableOptions(
    client_column="user",
    label_column="clicked",
    features=["city", "tags"],
    multi_hot=["tags"],
    numeric=["price"],
    test_fraction=0.0,
)


@dataclass(frozen=True)
class Row:
    user: str
    clicked: int
    city: str
    tags: tuple[str, ...]
    price: float


ROWS = st.lists(
    st.builds(
        Row,
        user=st.sampled_from(["u1", "u2", "u3", "ü4"]),
        clicked=st.integers(0, 1),
        city=st.sampled_from(CITIES),
        tags=st.lists(st.sampled_from(TAGS), max_size=3, unique=True).map(tuple),
        price=st.floats(-1e6, 1e6, allow_nan=False).map(lambda x: round(x, 3)),
    ),
    min_size=4,
    max_size=12,
).map(  # at least two clients and both labels: a table the loader must accept
    lambda rows: [
        dataclasses.replace(rows[0], user="u1", clicked=0),
        dataclasses.replace(rows[1], user="u2", clicked=1),
        *rows[2:],
    ]
)


def csv_text(rows: list[Row], quoting: int, label_form: str) -> str:
    out = io.StringIO()
    writer = csv.writer(out, quoting=quoting, lineterminator="\r\n" if quoting else "\n")
    writer.writerow(["user", "clicked", "city", "tags", "price"])
    for r in rows:
        label = {"int": str(r.clicked), "float": f"{r.clicked:.1f}"}[label_form]
        writer.writerow([r.user, label, r.city, "|".join(r.tags), repr(r.price)])
    return out.getvalue()


def write_parquet(path: Path, rows: list[Row], lists: bool, label_form: str) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    labels = {
        "int": [r.clicked for r in rows],
        "float": [float(r.clicked) for r in rows],
        "bool": [bool(r.clicked) for r in rows],
    }[label_form]
    tags = [list(r.tags) for r in rows] if lists else ["|".join(r.tags) for r in rows]
    table = pa.table(
        {
            "user": [r.user for r in rows],
            "clicked": labels,
            "city": [r.city for r in rows],
            "tags": tags,
            "price": [r.price for r in rows],
        }
    )
    pq.write_table(table, path)


def as_arrays(dataset) -> tuple:
    train = dataset.train
    return (
        dict(dataset.table_rows),
        train.ids["features"].values.tolist(),
        train.ids["features"].offsets.tolist(),
        train.labels.tolist(),
        np.round(train.dense, 4).tolist(),
        dataset.client_offsets.tolist(),
    )


ENCODINGS = ["utf-8", "utf-8-sig", "utf-16", "utf-16-le-bom", "cp1252", "latin-1"]


def encoded(text: str, encoding: str) -> tuple[bytes, str]:
    """The file's bytes and the data.encoding it needs ("auto" when none)."""
    if encoding == "utf-16-le-bom":
        return codecs.BOM_UTF16_LE + text.encode("utf-16-le"), "auto"
    if encoding in ("cp1252", "latin-1"):
        return text.encode(encoding), encoding
    return text.encode(encoding), "auto"


@SETTINGS
@given(
    rows=ROWS,
    encoding=st.sampled_from(ENCODINGS),
    quoting=st.sampled_from([csv.QUOTE_MINIMAL, csv.QUOTE_ALL]),
    label_form=st.sampled_from(["int", "float"]),
    parquet=st.sampled_from([None, "list", "text"]),
    parquet_label=st.sampled_from(["int", "float", "bool"]),
)
def test_one_table_reads_the_same_in_every_encoding_quoting_and_format(
    rows, encoding, quoting, label_form, parquet, parquet_label
):
    """The reported bugs: a UTF-8 file with Excel's byte-order mark lost its first column's
    name; a Parquet list column was read as its text form (another vocabulary)."""
    with tempfile.TemporaryDirectory() as folder:
        plain = Path(folder) / "plain.csv"
        plain.write_text(csv_text(rows, csv.QUOTE_MINIMAL, "int"), encoding="utf-8")
        expected = as_arrays(load(OPTIONS, str(plain), 0))
        other = Path(folder) / "other.csv"
        data, codec = encoded(csv_text(rows, quoting, label_form), encoding)
        other.write_bytes(data)
        options = TableOptions(**{**OPTIONS.__dict__, "encoding": codec})
        assert as_arrays(load(options, str(other), 0)) == expected
        event(f"csv {encoding}")
        if parquet is not None:
            path = Path(folder) / "t.parquet"
            write_parquet(path, rows, parquet == "list", parquet_label)
            assert as_arrays(load(OPTIONS, str(path), 0)) == expected
            event(f"parquet {parquet}")


# One bad cell: (column, value, what the error must say besides the file and the line)
BAD_CELLS = [
    ("clicked", "yes", "column 'clicked' (data.label_column) must hold numbers; it holds 'yes'"),
    ("clicked", "", "column 'clicked' (data.label_column) must hold numbers; it holds an empty"),
    ("clicked", "2", "label column 'clicked' must be 0 or 1, got '2'"),
    ("clicked", "abc", "it holds 'abc'"),
    ("price", "abc", "column 'price' (data.numeric) must hold numbers; it holds 'abc'"),
    ("price", " ", "column 'price' (data.numeric) must hold numbers; it holds an empty cell"),
    ("price", "1e39", "numeric columns must be finite numbers"),
    ("user", "", "empty client id in column 'user'"),
]
CONFIG = """
[data]
name = "table"
path = "{path}"
client_column = "user"
label_column = "clicked"
features = ["city", "tags"]
multi_hot = ["tags"]
numeric = ["price"]
test_fraction = 0.0
{extra}
"""


def stats(path: Path, extra: str = "") -> tuple[int, str]:
    config = path.with_name("c.toml")
    config.write_text(CONFIG.format(path=path, extra=extra), encoding="utf-8")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["data", "stats", str(config)])
    return code, err.getvalue()


def assert_one_error(code: int, err: str, *parts: str) -> None:
    assert "Traceback" not in err, err
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("fedsub: error: "), err
    for part in parts:
        assert part in line, (part, line)


@SETTINGS
@given(rows=ROWS, bad=st.sampled_from(BAD_CELLS), where=st.data(), parquet=st.booleans())
def test_one_bad_cell_is_named_by_file_line_column_and_value(rows, bad, where, parquet):
    column, value, message = bad
    i = where.draw(st.integers(0, len(rows) - 1))
    with tempfile.TemporaryDirectory() as folder:
        if parquet and column == "clicked":
            parquet = False  # a typed Parquet column cannot hold the text; CSV then
        if parquet:
            pytest.importorskip("pyarrow")
            import pyarrow as pa
            import pyarrow.parquet as pq

            path = Path(folder) / "t.parquet"
            table = {
                "user": [r.user for r in rows],
                "clicked": [r.clicked for r in rows],
                "city": [r.city for r in rows],
                "tags": [list(r.tags) for r in rows],
                "price": [repr(r.price) for r in rows],  # as text, to hold the bad value
            }
            table[column][i] = value
            pq.write_table(pa.table(table), path)
            unit = f"row {i}"
        else:
            text = csv_text(rows, csv.QUOTE_MINIMAL, "int").splitlines()
            cells = next(csv.reader([text[i + 1]]))
            cells[["user", "clicked", "city", "tags", "price"].index(column)] = value
            out = io.StringIO()
            csv.writer(out, lineterminator="").writerow(cells)
            text[i + 1] = out.getvalue()
            path = Path(folder) / "t.csv"
            path.write_text("\n".join(text) + "\n", encoding="utf-8")
            unit = f"line {i + 2}"
        event(f"{'parquet' if parquet else 'csv'} {column}={value!r}")
        code, err = stats(path)
        if column == "user" and len({r.user for j, r in enumerate(rows) if j != i}) < 2:
            assert code == 2 and "Traceback" not in err  # one client left: its own error
            return
        assert_one_error(code, err, str(path), unit, message)


@SETTINGS
@given(rows=ROWS, encoding=st.sampled_from(["cp1252", "latin-1"]))
def test_a_byte_that_is_not_utf8_is_named_by_offset_and_line(rows, encoding):
    text = csv_text(rows, csv.QUOTE_MINIMAL, "int")
    data = text.encode(encoding)
    first = next((i for i, ch in enumerate(data) if ch >= 0x80), None)
    if first is None:
        return  # all ASCII: the same bytes in UTF-8
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.csv"
        path.write_bytes(data)
        code, err = stats(path)
        line = data.count(b"\n", 0, first) + 1
        assert_one_error(code, err, str(path), f"at offset {first} (line {line})", "UTF-8")
        assert stats(path, f'encoding = "{encoding}"')[0] == 0  # named, it reads


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('list_separator = ""', "data.list_separator = '' is not allowed"),
        ('encoding = "klingon"', "data.encoding = 'klingon' is not allowed: not a known"),
    ],
)
def test_options_that_cannot_work_are_refused_naming_the_key(tmp_path, extra, message):
    path = tmp_path / "t.csv"
    path.write_text("user,clicked,city,tags,price\nu1,1,a,,1\nu2,0,b,,2\n")
    assert_one_error(*stats(path, extra), message)


def test_no_input_column_is_refused_and_numeric_only_reads_dense(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("user,clicked,city,tags,price\nu1,1,a,,1\nu2,0,b,,2\nu1,0,c,,3\nu2,1,d,,4\n")
    config = CONFIG.format(path=path, extra="").replace('features = ["city", "tags"]', "")
    config = config.replace('multi_hot = ["tags"]', "")
    (tmp_path / "c.toml").write_text(config.replace('numeric = ["price"]', ""))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["data", "stats", str(tmp_path / "c.toml")]) == 2
    assert "data.features and data.numeric are both empty" in err.getvalue()
    dense_only = load(TableOptions("user", "clicked", numeric=["price"]), str(path), 0)
    assert dense_only.table_rows == {} and dense_only.train.ids == {}
    assert dense_only.train.dense_dim == 1
