"""Start ``translator serve`` as a real process and wait until it is ready: the one launcher
of the benchmarks (``bench.load``, ``bench.overload``, ``bench.soak``) and the tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_server(
    env: dict[str, str] | None = None, ready_timeout: float = 120.0, port: int | None = None
) -> Iterator[str]:
    """Start ``translator serve`` as a real process (on ``port``, else a free one) with these
    environment variables on top of this process's; yield its base URL once /ready answers 200.

    Output goes to a file (a pipe nobody reads would block a chatty server); it is shown if
    the server exits or never gets ready.
    """
    port = free_port() if port is None else port
    full_env = {**os.environ, "TRANSLATOR_HOST": "127.0.0.1", "TRANSLATOR_PORT": str(port), **(env or {})}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve"], cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc, ready_timeout, log)
            yield url
        finally:
            stop(proc)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float, log: IO[str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = ""
            if log is not None:
                log.seek(0)
                output = log.read()
            raise RuntimeError(f"server exited with {proc.returncode}:\n{output[-4000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
