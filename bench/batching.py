"""Static against continuous batching, in one process: the model side of ``bench/load.py``.

    python -m bench.batching [--beam-size 4] [--batch 64] [--limit N] [--repeat 3] [--no-shortlist]

Translates test_2016_flickr de→en with the shipped weights (2 threads, fp32; the checkpoint's
lexical shortlist where it ships one, as the service decodes: ``--no-shortlist`` for the whole
vocabulary) in three ways and prints one JSON line per way:

- ``static-sorted``: sentences sorted by length, batches of ``--batch`` run one after the
  other (``bench/decode.py``'s setup: the best case for static batches);
- ``static-arrival``: the same batches in arrival order (shuffled with a fixed seed), each run
  until its last sentence is done (a server's static batches under a full queue);
- ``continuous``: arrival order, one running batch kept near ``--batch`` sentences: queued
  ones join it before a decoder step once it has room for ``--join-group`` of them (or for all
  that are left), as the server's scheduler does under load (``TRANSLATOR_JOIN_GROUP``; 1: at
  every step that sentences left).

Keys: mode, sentences, seconds (median of ``--repeat`` passes), sentences_per_s, steps
(decoder steps), sentence_steps (sum over steps of the sentences decoded at it), mean_active,
vocabulary (``shortlist`` or ``full``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.stats import median
from model.engine import loading
from model.engine.options import DecodingOptions
from model.engine.translator import Translator
from model.training.data import MULTI30K_DIR, read_lines

ROOT = Path(__file__).resolve().parents[1]
MODES = ("static-sorted", "static-arrival", "continuous")


@dataclass(frozen=True)
class BatchingResult:
    mode: str
    sentences: int
    seconds: float
    sentences_per_s: float
    steps: int
    sentence_steps: int
    mean_active: float
    admissions: int  # calls that encoded sentences joining (or starting) the batch
    beam_size: int
    batch: int
    join_group: int
    vocabulary: str  # "shortlist" (the checkpoint's, as the service decodes) or "full"


def run(
    translator: Translator, ids: list[list[int]], options: DecodingOptions, batch: int, refill: bool, group: int = 1
) -> tuple[int, int, int]:
    """Decode ``ids`` in order through one session: a new batch of ``batch`` when it is empty,
    or (``refill``) topped up to ``batch`` before a step once it has room for ``group`` (or for
    every sentence left) -> (steps, sentence-steps, admissions)."""
    session = translator.open_session(options)
    queued, done, steps, sentence_steps, admissions = 0, 0, 0, 0, 0
    group = min(group, batch)
    while done < len(ids):
        room = batch - session.active
        joins = refill and room >= min(group, len(ids) - queued)
        if queued < len(ids) and room > 0 and (joins or session.active == 0):
            joining = ids[queued : queued + room]
            session.admit(joining, range(queued, queued + len(joining)))
            queued += len(joining)
            admissions += 1
        sentence_steps += session.active
        done += len(session.step())
        steps += 1
    return steps, sentence_steps, admissions


def measure(
    mode: str, translator: Translator, ids: list[list[int]], options: DecodingOptions, args: argparse.Namespace
) -> BatchingResult:
    vocabulary = loading.vocabulary_label(translator.shortlist)
    order = sorted(ids, key=len) if mode == "static-sorted" else ids
    passes: list[float] = []
    counts = (0, 0, 0)
    for _ in range(args.repeat):
        start = time.perf_counter()
        counts = run(translator, order, options, args.batch, refill=mode == "continuous", group=args.join_group)
        passes.append(time.perf_counter() - start)
    seconds = median(passes)
    steps, sentence_steps, admissions = counts
    return BatchingResult(
        mode, len(ids), round(seconds, 3), round(len(ids) / seconds, 2), steps, sentence_steps,
        round(sentence_steps / steps, 1), admissions, options.beam_size, args.batch, args.join_group, vocabulary,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", type=Path, default=ROOT / "weights" / "de-en")
    parser.add_argument("--data-dir", type=Path, default=MULTI30K_DIR)
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="sentences per batch (the server's default)")
    parser.add_argument(
        "--join-group", type=int, default=16, help="continuous: sentences join in groups of this many (the server's)"
    )
    parser.add_argument("--limit", type=int, default=0, help="first N sentences only (0: all)")
    parser.add_argument("--repeat", type=int, default=3, help="passes per mode (median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--shortlist", action=argparse.BooleanOptionalAction, default=True, help="the checkpoint's shortlist"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ckpt = loading.load(args.weights, "cpu", "float32")
    translator = Translator(ckpt.model, ckpt.tokenizer, shortlist=loading.use_shortlist(ckpt, args.shortlist))
    texts = read_lines(args.data_dir / "test_2016_flickr.de.gz")
    texts = texts[: args.limit] if args.limit else texts
    ids = translator.encode(texts)
    random.Random(0).shuffle(ids)  # arrival order
    options = DecodingOptions(beam_size=args.beam_size)
    translator.decode_ids(ids[:8], options)  # warm-up
    for mode in args.modes.split(","):
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
        print(json.dumps(asdict(measure(mode, translator, ids, options, args))), flush=True)


if __name__ == "__main__":
    main()
