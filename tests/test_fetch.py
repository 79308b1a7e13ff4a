"""`fedsub data fetch` against an HTTP server on 127.0.0.1 serving files the test makes."""

from __future__ import annotations

import hashlib
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from fedsub.cli import main
from fedsub.data.fetch import Download, fetch
from fedsub.errors import DataError

PAYLOAD = bytes(range(256)) * 4000  # ~1 MB


class Server:
    """Serves PAYLOAD with Range support; ``cut_after`` bytes then drops the connection."""

    def __init__(self, payload: bytes = PAYLOAD, filename: str = "ml-1m.zip") -> None:
        self.payload = payload
        self.cut_after: int | None = None
        self.requests: list[str | None] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                owner.requests.append(self.headers.get("Range"))
                start = 0
                if self.headers.get("Range"):
                    start = int(self.headers["Range"].split("=")[1].split("-")[0])
                    self.send_response(206)
                else:
                    self.send_response(200)
                body = owner.payload[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if owner.cut_after is not None:
                    self.wfile.write(body[: owner.cut_after])
                    owner.cut_after = None
                    self.wfile.flush()
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/{filename}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSUB_DATA", str(tmp_path / "cache"))
    return tmp_path / "cache"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_fetch_succeeds_and_is_cached(server, cache, capsys):
    assert (
        main(["data", "fetch", "movielens-1m", "--url", server.url, "--checksum", sha256(PAYLOAD)])
        == 0
    )
    path = cache / "movielens-1m" / "ml-1m.zip"
    assert path.read_bytes() == PAYLOAD
    assert str(path) in capsys.readouterr().out
    fetch("movielens-1m", Download(server.url, "ml-1m.zip", sha256(PAYLOAD)))
    assert len(server.requests) == 1  # the second call used the cache


def test_checksum_mismatch_removes_the_partial_file(server, cache, capsys):
    wrong = "sha256:" + "0" * 64
    assert main(["data", "fetch", "movielens-1m", "--url", server.url, "--checksum", wrong]) == 2
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and "the partial file was removed" in err
    assert not cache.exists()  # no empty cache folder left behind


def test_cut_off_transfer_leaves_no_cache_entry_and_a_retry_resumes(server, cache):
    download = Download(server.url, "ml-1m.zip", sha256(PAYLOAD))
    server.cut_after = 300_000
    with pytest.raises(DataError, match=r"cut off|failed"):
        fetch("movielens-1m", download)
    folder = cache / "movielens-1m"
    assert not (folder / "ml-1m.zip").exists()
    assert 0 < (folder / "ml-1m.zip.part").stat().st_size <= 300_000
    path = fetch("movielens-1m", download)
    assert path.read_bytes() == PAYLOAD
    assert server.requests[-1] is not None and server.requests[-1].startswith("bytes=")
    assert not (folder / "ml-1m.zip.part").exists()


def test_unknown_dataset_is_explained(capsys):
    assert main(["data", "fetch", "amazon-fedsubavg"]) == 2
    assert "has no official download" in capsys.readouterr().err


def test_multi_file_set_from_a_mirror_folder(cache, monkeypatch, capsys):
    """mnist's four IDX files fetched from a folder URL, checked against (test) pins."""
    from fedsub.data import fetch as fetch_module

    server = Server()
    try:
        base = server.url.rsplit("/", 1)[0] + "/"
        files = fetch_module.DOWNLOADS["mnist"]
        monkeypatch.setitem(
            fetch_module.DOWNLOADS,
            "mnist",
            tuple(Download(d.url, d.filename, sha256(PAYLOAD)) for d in files),
        )
        assert main(["data", "fetch", "mnist", "--url", base]) == 0
        printed = capsys.readouterr().out.split()
        assert [p.rsplit("/", 1)[1] for p in printed] == [d.filename for d in files]
        assert all((cache / "mnist" / d.filename).read_bytes() == PAYLOAD for d in files)
    finally:
        server.close()


def test_a_size_mismatch_removes_the_partial_file(server, cache):
    download = Download(server.url, "ml-1m.zip", sha256(PAYLOAD), size=len(PAYLOAD) + 1)
    with pytest.raises(DataError, match=r"expected 1,024,001; the partial file was removed"):
        fetch("movielens-1m", download)
    assert not cache.exists()


def test_a_mirror_is_held_to_the_official_pins(server, cache, capsys):
    """--url alone keeps ml-1m's published size and sha256, so other bytes are refused."""
    assert main(["data", "fetch", "movielens-1m", "--url", server.url]) == 2
    assert "expected 5,917,549" in capsys.readouterr().err
    assert not (cache / "movielens-1m" / "ml-1m.zip").exists()


def test_pins_are_sha256_with_sizes():
    from fedsub.data.fetch import DOWNLOADS

    for name, downloads in DOWNLOADS.items():
        for download in downloads:
            assert download.size and download.size > 0, name
            if download.checksum is not None:
                algorithm, _, digest = download.checksum.partition(":")
                assert algorithm == "sha256" and len(bytes.fromhex(digest)) == 32, name
    assert DOWNLOADS["amazon-electronics"][0].checksum is None  # no public checksum exists


def test_an_unpinned_file_needs_consent_and_records_its_sha256(cache, monkeypatch, capsys):
    from fedsub.data import fetch as fetch_module
    from fedsub.data.amazon import AmazonRatingsOptions, load_ratings_csv

    rows = [f"u{u},i{(u + k) % 5},{1 + (u + k) % 5},{100 + k}" for u in range(3) for k in range(6)]
    body = ("\n".join(rows) + "\n").encode()
    server = Server(body, "ratings_Electronics.csv")
    try:
        official = fetch_module.DOWNLOADS["amazon-electronics"][0]
        monkeypatch.setitem(
            fetch_module.DOWNLOADS,
            "amazon-electronics",
            (Download(server.url, official.filename, None, len(body)),),
        )
        assert main(["data", "fetch", "amazon-electronics"]) == 2
        assert "--unpinned" in capsys.readouterr().err
        assert not (cache / "amazon-electronics" / official.filename).exists()
        assert main(["data", "fetch", "amazon-electronics", "--unpinned"]) == 0
    finally:
        server.close()
    folder = cache / "amazon-electronics"
    recorded = (folder / (official.filename + ".sha256")).read_text().split()[0]
    assert recorded == hashlib.sha256(body).hexdigest()
    dataset = load_ratings_csv(AmazonRatingsOptions(min_ratings=6), None, 0)  # from the cache
    assert dataset.num_clients == 3 and len(dataset.train) == 18


def test_sent140_reads_the_fetched_official_zip(cache, monkeypatch, tmp_path):
    from fedsub.data import fetch as fetch_module
    from fedsub.data.sent140 import TRAINING_CSV, Sent140Options, load

    from .test_sent140_lstm import tweets, write_csv

    write_csv(tmp_path / TRAINING_CSV, tweets())
    archive = tmp_path / "trainingandtestdata.zip"
    with zipfile.ZipFile(archive, "w") as handle:
        handle.write(tmp_path / TRAINING_CSV, TRAINING_CSV)
        handle.writestr("testdata.manual.2009.06.14.csv", "")
    body = archive.read_bytes()
    server = Server(body, archive.name)
    try:
        monkeypatch.setitem(
            fetch_module.DOWNLOADS,
            "sent140",
            (Download(server.url, archive.name, sha256(body), len(body)),),
        )
        assert main(["data", "fetch", "sent140"]) == 0
    finally:
        server.close()
    from_cache = load(Sent140Options(), None, 0)
    from_csv = load(Sent140Options(), str(tmp_path / TRAINING_CSV), 0)
    assert from_cache.num_clients == from_csv.num_clients == 4
    assert np.array_equal(from_cache.train.labels, from_csv.train.labels)
    for part in ("values", "offsets"):
        words = (from_cache.train.ids["words"], from_csv.train.ids["words"])
        assert np.array_equal(getattr(words[0], part), getattr(words[1], part))


def test_sent140_without_data_explains_how_to_get_it(cache):
    from fedsub.data.sent140 import Sent140Options, load

    with pytest.raises(DataError, match=r"fedsub data fetch sent140"):
        load(Sent140Options(), None, 0)


def test_fetch_without_a_name_lists_what_can_be_fetched(cache, capsys):
    (cache / "sent140").mkdir(parents=True)
    (cache / "sent140" / "trainingandtestdata.zip").write_bytes(b"x")
    assert main(["data", "fetch"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80
    files = {line.split()[0]: line for line in lines if line.startswith("  ") and "bytes" in line}
    assert "81,363,704 bytes" in files["trainingandtestdata.zip"]
    assert files["trainingandtestdata.zip"].endswith("  cached")
    assert "no checksum published" in files["ratings_Electronics.csv"]
    assert files["ml-1m.zip"].endswith("not cached")
    assert "  https://files.grouplens.org/datasets/movielens/ml-1m.zip" in lines


def test_a_download_that_never_started_mentions_no_partial_file(cache):
    download = Download("http://127.0.0.1:9/ml-1m.zip", "ml-1m.zip", "sha256:" + "0" * 64)
    with pytest.raises(DataError, match="nothing was downloaded") as error:
        fetch("movielens-1m", download, timeout=5)
    assert ".part" not in str(error.value)
    assert not cache.exists()  # offline: no empty cache folder left behind


def test_offline_fetch_keeps_an_existing_cache_folder(cache, capsys):
    (cache / "mnist").mkdir(parents=True)
    (cache / "mnist" / "notes.txt").write_text("mine")
    url = "http://127.0.0.1:9/"
    assert main(["data", "fetch", "movielens-1m", "--url", url + "ml-1m.zip"]) == 2
    assert "nothing was downloaded" in capsys.readouterr().err
    assert sorted(p.name for p in cache.iterdir()) == ["mnist"]
