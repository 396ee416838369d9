"""Load benchmark of the real server: closed-loop clients sending one sentence per request.

    python -m bench.load [--concurrency 1,4,16,64] [--requests 512] [--batching on,off]
                         [--weights weights] [--beam-size N] [--threads 2] [--rounds 1] [--offline]

For each batching mode it starts ``translator serve`` as a separate process (batching
off = at most one sentence per model batch; the translation cache is off in both), then
for each concurrency runs that many clients, each sending its next test_2016_flickr
sentence as soon as its previous answer arrives, until ``--requests`` are done. One JSON
line per run: concurrency, batching, requests, rps, p50_ms, p95_ms, p99_ms, errors. With
``--rounds N`` the sweep runs N times (servers restarted, modes alternating) and each row is
the round with the median requests/s, plus ``rounds_rps`` (a small machine's speed drifts).
``--url`` measures a LibreTranslate-compatible server that is already running (ours, or
LibreTranslate itself: its rows say ``"batching": "external"``). Rows of servers that send
``Server-Timing`` (ours) get ``phases_ms``: each phase's median over the run's requests.
``--offline`` decodes the same sentences offline (sorted batches of 64, the server's
``TRANSLATOR_DTYPE``) before and after each round and adds that round's ``offline_sps`` (the
mean of the two; both in ``offline_around``; a round's after is the next one's before) and
``of_offline`` (rps / offline_sps) to its rows:
how close serving comes to the model's own batched throughput, each round against offline
figures taken on both sides of it (a shared host's speed drifts between rounds and within
minutes, so one offline figure, for all rounds or before each, moves the ratios with it:
docs/benchmarks/log/2026-11-29.md#chunks-claimed-and-a-joiners-first-step-on-one-row-session-of-2026-11-29-1413).
With ``--rounds N`` the rows also get ``rounds_offline_sps`` and ``rounds_of_offline``, every
round's. The clients run in this process, on the same machine as the server, so they share its
CPU: they speak HTTP/1.1 over keep-alive connections through asyncio streams (``Connection``),
which cost a small fraction of the CPU httpx's async client took per request; with httpx the
clients took a large share of the cores the server needed
(docs/benchmarks/README.md#numbers-behind-the-code). Each row says how much: ``client_cores`` is
the CPU time this process spent during the run over its wall time, and ``server_cores`` the
server's (``process_cpu_seconds_total`` from its ``/metrics``, before and after; null for a
server without it). For a server on this machine, ``server_threads`` splits the run's wall time
per server thread into time on a CPU, time waiting for one and time asleep (``bench/threads.py``):
where serving loses against offline.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import threads as thread_times
from bench.server import ROOT, running_server
from bench.stats import median, median_row, percentile
from model import checkpoint
from model.training.data import MULTI30K_DIR, read_lines
from model.training.progress import progress

SOURCE, TARGET = "de", "en"  # every request: a test_2016 German sentence to English

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
    offline_sps: float | None = None  # the same model offline on the same sentences (``--offline``)
    offline_around: list[float] | None = None  # offline_sps taken before and after the round
    of_offline: float | None = None  # rps / offline_sps
    phases_ms: dict[str, float] | None = None  # median of each Server-Timing phase (servers that send it)
    client_cores: float | None = None  # this process's CPU seconds during the run / its wall seconds
    server_cores: float | None = None  # the server's, from its /metrics (servers that export it)
    # a local server's threads: each one's shares of the run on a CPU, waiting for one, asleep
    server_threads: list[dict[str, float | str]] | None = None


def server_timing(value: str) -> dict[str, float]:
    """A ``Server-Timing`` header ("name;dur=ms, ...") -> {name: ms}; entries without dur are skipped."""
    out: dict[str, float] = {}
    for entry in value.split(","):
        name, *params = (p.strip() for p in entry.split(";"))
        for param in params:
            key, _, number = param.partition("=")
            if key.lower() == "dur":
                with suppress(ValueError):
                    out[name] = float(number)
    return out


class Connection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads Content-Length replies."""

    def __init__(self, url: str, timeout: float = 120.0) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.timeout = timeout
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.headers: dict[str, str] = {}  # of the last reply (lower-case names)

    async def post_json(self, path: str, payload: object) -> tuple[int, bytes]:
        """-> (status, body); reconnects when the server closed the connection."""
        return await asyncio.wait_for(self._post(path, json.dumps(payload).encode()), self.timeout)

    async def _post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status = int((await self.reader.readline()).split()[1])
        length, close = 0, False
        self.headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            name = name.strip().lower()
            self.headers[name] = value.strip()
            if name == "content-length":
                length = int(value)
            elif name == "connection":
                close = value.strip().lower() == "close"
            elif name == "transfer-encoding":
                raise ValueError("chunked replies are not supported")
        reply = await self.reader.readexactly(length)
        if close:
            self.close()
        return status, reply

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def closed_loop(url: str, sentences: list[str], concurrency: int, requests: int, beam: int) -> LoadResult:
    """``concurrency`` clients, each sending its next request when the last one is answered."""
    latencies: list[float] = []
    phases: dict[str, list[float]] = {}
    errors = 0
    counter = iter(range(requests))
    bar = progress(requests, f"{concurrency} clients", unit="request")

    async def client() -> None:
        nonlocal errors
        connection = Connection(url)
        try:
            for i in counter:
                body = {"q": sentences[i % len(sentences)], "source": SOURCE, "target": TARGET, "beam_size": beam}
                start = time.perf_counter()
                try:
                    status, reply = await connection.post_json("/translate", body)
                    ok = status == 200 and "translatedText" in json.loads(reply)
                except (TimeoutError, OSError, ValueError, IndexError, asyncio.IncompleteReadError):
                    connection.close()
                    ok = False
                latencies.append(time.perf_counter() - start)
                errors += not ok
                bar.update()
                for name, ms in server_timing(connection.headers.get("server-timing", "") if ok else "").items():
                    phases.setdefault(name, []).append(ms)
        finally:
            connection.close()

    server_cpu = cpu_seconds(url)  # (before and after the clients run: blocking is harmless)
    pid = local_pid(url)
    threads_before = thread_times.sample(pid) if pid is not None else None
    start, cpu = time.perf_counter(), time.process_time()
    with bar:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    threads_after = thread_times.sample(pid) if pid is not None else None
    client_cores = (time.process_time() - cpu) / elapsed
    server_after = cpu_seconds(url)
    server_cores = None if server_cpu is None or server_after is None else (server_after - server_cpu) / elapsed
    ms = [1000 * x for x in latencies]
    return LoadResult(
        concurrency,
        "",
        requests,
        round(requests / elapsed, 2),
        round(median(ms), 1),
        round(percentile(ms, 95), 1),
        round(percentile(ms, 99), 1),
        errors,
        beam,
        phases_ms={name: round(median(v), 2) for name, v in phases.items()} or None,
        client_cores=round(client_cores, 3),
        server_cores=None if server_cores is None else round(server_cores, 3),
        server_threads=(
            [asdict(share) for share in thread_times.shares(pid, threads_before, threads_after, requests)]
            if pid is not None and threads_before and threads_after
            else None
        ),
    )


def local_pid(url: str) -> int | None:
    """The process serving ``url`` when it listens on this machine (``bench.threads``), else None."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost
        local = False
    if not local:
        return None
    return thread_times.listening_pid(parts.port or (443 if parts.scheme == "https" else 80))


def server_metric(url: str, name: str) -> float | None:
    """The first sample called ``name`` (e.g. the process collector's ``process_cpu_seconds_total``)
    in the server's /metrics; None where the server answers no Prometheus text with it."""
    reply = httpx.get(f"{url}/metrics", timeout=10)
    if reply.status_code != 200:
        return None
    try:
        for family in text_string_to_metric_families(reply.text):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
    except ValueError:  # not Prometheus text
        return None
    return None


def cpu_seconds(url: str) -> float | None:
    """The server's CPU seconds so far (``process_cpu_seconds_total``); None where it has none."""
    try:
        return server_metric(url, "process_cpu_seconds_total")
    except httpx.HTTPError:
        return None


@contextmanager
def server(
    weights: Path, batching: bool, threads: int, port: int, extra_env: dict[str, str] | None = None
) -> Iterator[str]:
    """``translator serve`` on these weights as the benchmarks run it: no cache, a queue no
    load here fills, warnings-only logs; ``batching`` off serves one sentence per step."""
    env = {
        "TRANSLATOR_WEIGHTS_DIR": str(weights),
        "TRANSLATOR_CACHE_SIZE": "0",
        "TRANSLATOR_THREADS": str(threads),
        "TRANSLATOR_LOG_LEVEL": "warning",
        "TRANSLATOR_QUEUE_SIZE": "100000",
        "TRANSLATOR_HOST": "127.0.0.1",
    }
    if not batching:
        env["TRANSLATOR_MAX_BATCH_SENTENCES"] = "1"
    with running_server(env | (extra_env or {}), ready_timeout=180, port=port) as url:
        yield url


def served_folder(weights: Path, source: str, target: str) -> Path:
    """The checkpoint folder the server answers ``source``→``target`` from (the service's own
    rule, ``app.serving.service.assign_directions``); a one-direction model, since ``bench.decode``
    decodes without a many-to-many model's target tag."""
    from app.serving.service import assign_directions  # the rule the server applies

    folders = [p for p in sorted(weights.iterdir()) if (p / "config.json").is_file()]
    serving = [p for p, pairs in assign_directions(folders).items() if pairs and (source, target) in pairs]
    if not serving or len(checkpoint.directions(checkpoint.read_meta(serving[0]))) != 1:
        raise SystemExit(f"--offline: no one-direction model in {weights} serves {source}-{target}")
    return serving[0]


def offline_throughput(weights: Path, data: Path, sentences: int, beam: int, threads: int) -> float:
    """Sentences/s of the served model decoding the requests' sentences offline, in sorted
    batches of 64 (``bench.decode``'s ``ours`` in a process of its own, the server's
    ``TRANSLATOR_DTYPE`` as its precision)."""
    folder = served_folder(weights, SOURCE, TARGET)
    dtype = os.environ.get("TRANSLATOR_DTYPE", "float32").replace("auto", "float32")
    cmd = [sys.executable, "-m", "bench.decode", "--systems", "ours", "--no-isolate", "--weights", str(folder)]
    cmd += ["--beam-size", str(beam), "--limit", str(sentences), "--threads", str(threads), "--dtype", dtype]
    cmd += ["--data-dir", str(data)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return float(json.loads(out.splitlines()[-1])["sentences_per_s"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts")
    parser.add_argument("--requests", type=int, default=512, help="requests per run")
    parser.add_argument("--batching", default="on,off", help="on, off or both")
    parser.add_argument("--weights", type=Path, default=ROOT / "weights", help="weights folder to serve")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--data-dir", "--data", type=Path, default=MULTI30K_DIR)
    parser.add_argument(
        "--rounds", type=int, default=1, help="repeat the whole sweep; print each row's median-rps round"
    )
    parser.add_argument(
        "--url",
        help="measure this running LibreTranslate-compatible server (e.g. http://127.0.0.1:5000) instead of "
        "starting ours; --batching and --weights are then ignored",
    )
    parser.add_argument(
        "--offline", action="store_true", help="also decode the same sentences offline; rows get of_offline"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sentences = read_lines(args.data_dir / "test_2016_flickr.de.gz")
    levels = [int(c) for c in args.concurrency.split(",")]
    runs: dict[tuple[str, int], list[LoadResult]] = {}
    n = min(args.requests, len(sentences))

    def timed_offline() -> float:
        return offline_throughput(args.weights, args.data_dir, n, args.beam_size, args.threads)

    after = None  # the last round's offline figure after it: the next round's before it
    for _ in range(args.rounds):
        before = (timed_offline() if after is None else after) if args.offline else 0.0
        measured: list[LoadResult] = []
        for mode in args.batching.split(",") if args.url is None else ["external"]:
            with (
                server(args.weights, mode == "on", args.threads, args.port)
                if args.url is None
                else nullcontext(args.url.rstrip("/")) as url
            ):
                asyncio.run(closed_loop(url, sentences[-50:], 4, 50, args.beam_size))  # warm-up
                for concurrency in levels:
                    result = asyncio.run(closed_loop(url, sentences, concurrency, args.requests, args.beam_size))
                    measured.append(replace(result, batching=mode))
                    if args.rounds == 1 and not args.offline:  # (with --offline: once the round is timed after)
                        print(json.dumps(asdict(measured[-1])), flush=True)
        if args.offline:  # each round's own, from both sides of it: see the module's docstring
            after = timed_offline()
            offline = round((before + after) / 2, 2)
            measured = [
                replace(r, offline_sps=offline, offline_around=[before, after], of_offline=round(r.rps / offline, 3))
                for r in measured
            ]
        for result in measured:
            runs.setdefault((result.batching, result.concurrency), []).append(result)
            if args.rounds == 1 and args.offline:
                print(json.dumps(asdict(result)), flush=True)
    if args.rounds > 1:  # each row: the round with the median requests/s, and every round's
        for results in runs.values():
            middle = median_row(results, key=lambda r: r.rps)
            rounds: dict[str, list[float | None]] = {"rounds_rps": [r.rps for r in results]}
            if args.offline:
                rounds["rounds_offline_sps"] = [r.offline_sps for r in results]
                rounds["rounds_of_offline"] = [r.of_offline for r in results]
            print(json.dumps(asdict(middle) | rounds), flush=True)


if __name__ == "__main__":
    main()
