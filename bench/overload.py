"""Goodput under overload: a small queue, many clients, polite against impatient retries.

    python -m bench.overload [--clients 64] [--queue-size 8] [--requests 400] [--beam-size 4]
                             [--threads 2] [--rounds 1] [--weights weights]

Starts ``translator serve`` with ``TRANSLATOR_QUEUE_SIZE=--queue-size`` (cache off) and runs
``--clients`` closed-loop clients, each sending one test_2016 sentence per request until
``--requests`` have succeeded, twice:

- ``polite``: on 429 a client waits the ``Retry-After`` the server sent, then retries;
- ``impatient``: on 429 it retries at once (what many HTTP clients do).

One JSON line per behaviour: ``goodput_rps`` (successful requests/s), ``p50_ms``/``p99_ms`` of
successful requests (first try to answer), ``rejected`` (429 answers), ``reject_p50_ms``/
``reject_p90_ms``/``reject_p99_ms`` (how long a 429 took to arrive), ``errors`` (other statuses),
then ``{"impatient_over_polite": ...}``, the goodput ratio. The service aims for 429s answered
in a few ms under full load and a ratio of at least 0.7 (docs/reliability.md "Load").
With ``--rounds N`` each behaviour runs N times (a fresh server each time) and each line is
the median-goodput round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.load import ROOT, Connection, server
from bench.stats import median_row, percentile
from model.training.data import MULTI30K_DIR, read_lines


@dataclass(frozen=True)
class OverloadResult:
    behaviour: str
    clients: int
    queue_size: int
    requests: int
    goodput_rps: float
    p50_ms: float
    p99_ms: float
    rejected: int
    reject_p50_ms: float | None
    reject_p90_ms: float | None
    reject_p99_ms: float | None
    errors: int


async def run_clients(url: str, sentences: list[str], clients: int, requests: int, beam: int, polite: bool) -> dict:
    latencies: list[float] = []
    rejects: list[float] = []
    errors = 0
    counter = iter(range(requests))

    async def client() -> None:
        nonlocal errors
        connection = Connection(url)
        try:
            for i in counter:
                body = {"q": sentences[i % len(sentences)], "source": "de", "target": "en", "beam_size": beam}
                first = time.perf_counter()
                while True:
                    sent = time.perf_counter()
                    status, _ = await connection.post_json("/translate", body)
                    if status != 429:
                        break
                    rejects.append(time.perf_counter() - sent)
                    if polite:
                        await asyncio.sleep(float(connection.headers.get("retry-after", "1")))
                if status == 200:
                    latencies.append(time.perf_counter() - first)
                else:
                    errors += 1
        finally:
            connection.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - start
    ms = [1000 * x for x in latencies]
    rms = [1000 * x for x in rejects]
    return {
        "goodput_rps": round(len(latencies) / elapsed, 2),
        "p50_ms": round(percentile(ms, 50), 1),
        "p99_ms": round(percentile(ms, 99), 1),
        "rejected": len(rejects),
        "reject_p50_ms": round(percentile(rms, 50), 1) if rms else None,
        "reject_p90_ms": round(percentile(rms, 90), 1) if rms else None,
        "reject_p99_ms": round(percentile(rms, 99), 1) if rms else None,
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--queue-size", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400, help="successful requests per run")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--weights", type=Path, default=ROOT / "weights")
    parser.add_argument("--port", type=int, default=8792)
    parser.add_argument("--data-dir", "--data", type=Path, default=MULTI30K_DIR)
    args = parser.parse_args(argv)
    sentences = read_lines(args.data_dir / "test_2016_flickr.de.gz")
    env = {"TRANSLATOR_QUEUE_SIZE": str(args.queue_size)}
    rows: dict[str, list[OverloadResult]] = {"polite": [], "impatient": []}
    for _ in range(args.rounds):
        for behaviour in rows:
            with server(args.weights, True, args.threads, args.port, env) as url:
                asyncio.run(run_clients(url, sentences[-50:], 4, 50, args.beam_size, True))  # warm-up
                stats = asyncio.run(
                    run_clients(url, sentences, args.clients, args.requests, args.beam_size, behaviour == "polite")
                )
            rows[behaviour].append(OverloadResult(behaviour, args.clients, args.queue_size, args.requests, **stats))
    best = {b: median_row(r, key=lambda x: x.goodput_rps) for b, r in rows.items()}
    for behaviour, row in best.items():
        print(json.dumps(asdict(row) | {"rounds_goodput": [r.goodput_rps for r in rows[behaviour]]}), flush=True)
    ratio = best["impatient"].goodput_rps / max(best["polite"].goodput_rps, 1e-9)
    print(json.dumps({"impatient_over_polite": round(ratio, 3)}), flush=True)


if __name__ == "__main__":
    main()
