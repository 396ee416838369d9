"""translator data multi30k: the real download code against a local HTTP server that serves the
shared copy, including a corrupted file and a transfer cut off half way."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from model.training.multi30k import SHA256, DataError, ensure_split_files, fetch, file_names
from tests.helpers import ROOT

VAL = file_names(["val"], ["de", "en"])


class Mirror(BaseHTTPRequestHandler):
    """Serves the shared files; ``corrupt`` names get one byte changed, ``cut`` names stop after
    half their bytes (the connection closes with Content-Length unmet)."""

    root: ClassVar[Path]
    corrupt: ClassVar[set[str]] = set()
    cut: ClassVar[set[str]] = set()
    requests: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        name = self.path.rsplit("/", 1)[-1]
        Mirror.requests.append(name)
        file = Mirror.root / name
        if not file.is_file():
            self.send_error(404)
            return
        data = file.read_bytes()
        if name in Mirror.corrupt:
            data = bytes([data[0] ^ 1]) + data[1:]
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if name in Mirror.cut:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def mirror(data_dir: Path) -> Iterator[str]:
    Mirror.root, Mirror.corrupt, Mirror.cut, Mirror.requests = data_dir, set(), set(), []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Mirror)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/data/task1/raw/"
    server.shutdown()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_stored_checksums_are_those_of_the_shared_copy(data_dir: Path) -> None:
    assert {p.name: sha256(p) for p in data_dir.glob("*.gz")} == SHA256


def test_missing_files_are_downloaded_and_verified(mirror: str, tmp_path: Path, data_dir: Path) -> None:
    folder = fetch(VAL, tmp_path / "cache", mirror)
    assert sorted(p.name for p in folder.iterdir()) == sorted(VAL)
    assert all((folder / n).read_bytes() == (data_dir / n).read_bytes() for n in VAL)
    Mirror.requests.clear()
    assert fetch(VAL, folder, mirror) == folder and Mirror.requests == []  # nothing fetched twice


def test_a_wrong_checksum_keeps_no_file(mirror: str, tmp_path: Path) -> None:
    Mirror.corrupt = {"val.en.gz"}
    with pytest.raises(DataError, match=r"val\.en\.gz"):
        fetch(VAL, tmp_path, mirror)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["val.de.gz"]  # no corrupt or temporary file


def test_an_interrupted_transfer_keeps_no_file_and_the_next_run_completes(mirror: str, tmp_path: Path) -> None:
    Mirror.cut = {"val.de.gz"}
    with pytest.raises(DataError, match=r"val\.de\.gz"):
        fetch(VAL, tmp_path, mirror)
    assert list(tmp_path.iterdir()) == []
    Mirror.cut = set()
    fetch(VAL, tmp_path, mirror)
    assert all(sha256(tmp_path / n) == SHA256[n] for n in VAL)


def test_a_local_copy_is_used_as_it_is(tmp_path: Path, data_dir: Path) -> None:
    assert ensure_split_files(data_dir, ["val", "train"], ["de", "en"]) == data_dir  # no server needed
    missing = tmp_path / "not-there"
    assert ensure_split_files(missing, ["val"], ["de", "en"]) == data_dir  # the default: the shared copy
    (tmp_path / "own.de.gz").write_bytes(b"")
    with pytest.raises(DataError, match=r"own\.en\.gz"):
        ensure_split_files(tmp_path, ["own"], ["de", "en"])  # not Multi30k: nothing to download


@pytest.mark.slow
def test_the_command_downloads_into_the_folder_it_is_given(mirror: str, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "app.cli", "data", "multi30k", "--data-dir", str(tmp_path), "--base-url", mirror]
    done = subprocess.run([*cmd, "--splits", "val", "--languages", "de,en"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(tmp_path) and sorted(p.name for p in tmp_path.iterdir()) == sorted(VAL)
    Mirror.corrupt = {"val.fr.gz"}
    bad = subprocess.run([*cmd, "--splits", "val", "--languages", "fr"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "val.fr.gz" in bad.stderr and not (tmp_path / "val.fr.gz").exists()
