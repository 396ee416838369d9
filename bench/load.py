"""Load benchmark of the real server: closed-loop clients sending one sentence per request.

    python -m bench.load [--concurrency 1,4,16,64] [--requests 512] [--batching on,off]
                         [--weights weights] [--beam-size N] [--threads 2]

For each batching mode it starts ``translator serve`` as a separate process (batching
off = at most one sentence per model batch; the translation cache is off in both), then
for each concurrency runs that many clients, each sending its next test_2016_flickr
sentence as soon as its previous answer arrives, until ``--requests`` are done. One JSON
line per run: concurrency, batching, requests, rps, p50_ms, p95_ms, p99_ms, errors.
The clients run in this process, on the same machine as the server, so they share its CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from model.data import read_lines

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "multi30k"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    concurrency: int
    batching: str
    requests: int
    rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    errors: int
    beam_size: int


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))
    return ordered[index]


async def closed_loop(url: str, sentences: list[str], concurrency: int, requests: int, beam: int) -> LoadResult:
    """``concurrency`` clients, each sending its next request when the last one is answered."""
    latencies: list[float] = []
    errors = 0
    counter = iter(range(requests))

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal errors
        for i in counter:
            body = {"q": sentences[i % len(sentences)], "source": "de", "target": "en", "beam_size": beam}
            start = time.perf_counter()
            try:
                response = await http.post("/translate", json=body)
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - start)
            errors += not ok

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    ms = [1000 * x for x in latencies]
    return LoadResult(
        concurrency,
        "",
        requests,
        round(requests / elapsed, 2),
        round(statistics.median(ms), 1),
        round(percentile(ms, 95), 1),
        round(percentile(ms, 99), 1),
        errors,
        beam,
    )


@contextmanager
def server(weights: Path, batching: bool, threads: int, port: int) -> Iterator[str]:
    env = {
        **os.environ,
        "TRANSLATOR_WEIGHTS_DIR": str(weights),
        "TRANSLATOR_PORT": str(port),
        "TRANSLATOR_HOST": "127.0.0.1",
        "TRANSLATOR_CACHE_SIZE": "0",
        "TRANSLATOR_THREADS": str(threads),
        "TRANSLATOR_LOG_LEVEL": "warning",
        "TRANSLATOR_QUEUE_SIZE": "100000",
    }
    if not batching:
        env["TRANSLATOR_MAX_BATCH_SENTENCES"] = "1"
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    out.seek(0)
                    raise RuntimeError(f"server did not become ready:\n{out.read()[-3000:]}")
                try:
                    if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts")
    parser.add_argument("--requests", type=int, default=512, help="requests per run")
    parser.add_argument("--batching", default="on,off", help="on, off or both")
    parser.add_argument("--weights", type=Path, default=ROOT / "weights", help="weights folder to serve")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sentences = read_lines(args.data / "test_2016_flickr.de.gz")
    levels = [int(c) for c in args.concurrency.split(",")]
    for mode in args.batching.split(","):
        with server(args.weights, mode == "on", args.threads, args.port) as url:
            asyncio.run(closed_loop(url, sentences[-50:], 4, 50, args.beam_size))  # warm-up
            for concurrency in levels:
                result = asyncio.run(closed_loop(url, sentences, concurrency, args.requests, args.beam_size))
                print(json.dumps(asdict(result) | {"batching": mode}), flush=True)


if __name__ == "__main__":
    main()
