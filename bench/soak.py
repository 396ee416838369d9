"""Memory soak of the real server: thousands of distinct requests of varied lengths and beams.

    python -m bench.soak [--requests 4000] [--concurrency 16] [--cache on] [--warmup 300]
                         [--sample-every 250] [--weights weights] [--threads 2]
                         [--env NAME=VALUE ...]

Starts ``translator serve`` (as ``bench.load`` does; translation cache on or off), sends
``--requests`` distinct requests from closed-loop clients (each 1-4 consecutive Multi30k
training sentences, beam 1, 2, 4 or 8 in turn, so sentence counts, lengths and beam widths
all vary) and reads the server's resident memory from its own ``/metrics``
(``process_resident_memory_bytes``) at ready, every ``--sample-every`` requests and 2 s after
the last one. Prints one JSON line per sample (``requests``, ``rss_mb``) and a summary:
``rss_ready_mb``, ``rss_warm_mb`` (2 s after the ``--warmup`` requests), ``rss_peak_mb``,
``rss_end_mb`` (the last sample), ``rss_idle_mb``, ``growth_after_warmup`` (end / warm - 1),
``growth_idle`` (idle / warm - 1), ``growth_under_load`` (the last sample taken while requests
were in flight over the first one) and ``peak_over_ready``. Warm and idle are both taken with the
model out of work (its batch's memory dropped, the heap trimmed), so ``growth_idle`` is what a
soak leaves behind; samples under load also hold the running batch and the free heap that the
malloc tuning keeps while decoding goes on, so ``growth_after_warmup`` compares unlike states
whenever the last sample falls under load. A flat server keeps ``growth_idle`` and
``growth_under_load`` within 0.15 and ``peak_over_ready`` within 2.
``--env`` passes extra variables to the server (allocator experiments: ``MALLOC_ARENA_MAX=2``,
``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from bench.load import ROOT, Connection, server, server_metric
from model.training.data import MULTI30K_DIR, read_lines
from model.training.progress import progress

BEAMS = (1, 2, 4, 8)


def rss_mb(url: str) -> float:
    value = server_metric(url, "process_resident_memory_bytes")
    if value is None:
        raise KeyError("process_resident_memory_bytes not exported")
    return round(value / 2**20, 1)


def request_body(sentences: list[str], i: int) -> dict[str, object]:
    """The i-th request: 1-4 consecutive sentences (distinct for every i), a beam from BEAMS."""
    start = (3 * i) % (len(sentences) - 4)
    return {"q": " ".join(sentences[start : start + 1 + i % 4]), "source": "de", "target": "en",
            "beam_size": BEAMS[i % len(BEAMS)]}  # fmt: skip


async def soak(url: str, sentences: list[str], requests: int, concurrency: int, every: int) -> list[dict[str, float]]:
    samples: list[dict[str, float]] = []
    counter = iter(range(requests))
    done = 0
    errors = 0
    bar = progress(requests, "soak", unit="request")

    async def client() -> None:
        nonlocal done, errors
        connection = Connection(url)
        try:
            for i in counter:
                status, _ = await connection.post_json("/translate", request_body(sentences, i))
                errors += status != 200
                done += 1
                bar.update()
                if done % every == 0:
                    rss = await asyncio.to_thread(rss_mb, url)
                    samples.append({"requests": done, "rss_mb": rss})
                    print(json.dumps(samples[-1]), flush=True)
        finally:
            connection.close()

    with bar:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    if errors:
        raise RuntimeError(f"{errors} of {requests} requests failed")
    return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--cache", choices=("on", "off"), default="on")
    parser.add_argument("--warmup", type=int, default=300, help="requests before the 'warm' sample")
    parser.add_argument("--sample-every", type=int, default=250)
    parser.add_argument("--weights", type=Path, default=ROOT / "weights")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--data-dir", "--data", type=Path, default=MULTI30K_DIR)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="extra server environment")
    args = parser.parse_args(argv)
    sentences = read_lines(args.data_dir / "train.de.gz")
    env = {"TRANSLATOR_CACHE_SIZE": "10000" if args.cache == "on" else "0", "TRANSLATOR_MAX_BEAM": "8"}
    env |= dict(item.split("=", 1) for item in args.env)
    with server(args.weights, True, args.threads, args.port, env) as url:
        ready = rss_mb(url)
        print(json.dumps({"requests": 0, "rss_mb": ready}), flush=True)
        warm_samples = asyncio.run(soak(url, sentences, args.warmup, args.concurrency, args.warmup))
        time.sleep(2)  # as before ``idle``: the model is out of work and has trimmed its heap
        warm = rss_mb(url)
        rest = asyncio.run(soak(url, sentences[::-1], args.requests - args.warmup, args.concurrency, args.sample_every))
        end = rest[-1]["rss_mb"] if rest else warm
        time.sleep(2)
        idle = rss_mb(url)
    peak = max([ready, warm, idle, *(s["rss_mb"] for s in warm_samples + rest)])
    loaded = [s["rss_mb"] for s in rest if s["requests"] < args.requests - args.warmup]  # (the last one: all answered)
    summary = {
        "requests": args.requests, "concurrency": args.concurrency, "cache": args.cache, "env": args.env,
        "rss_ready_mb": ready, "rss_warm_mb": warm, "rss_peak_mb": peak, "rss_end_mb": end, "rss_idle_mb": idle,
        "growth_after_warmup": round(end / warm - 1, 3), "growth_idle": round(idle / warm - 1, 3),
        "growth_under_load": round(loaded[-1] / loaded[0] - 1, 3) if loaded else None,
        "peak_over_ready": round(peak / ready, 3),
    }  # fmt: skip
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
