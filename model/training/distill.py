"""Synthetic training text: a shipped model's translations of a training file.

    python -m model.training.distill --weights weights/en-de --src ../shared/data/multi30k/train.en.gz \
        --out runs/synthetic/train.en-de.de.gz [--beam-size N] [--batch-size N] [--threads N]

Writes one translation per source line, in order (gzip when ``--out`` ends in .gz), so that the
file pairs line by line with the source or with another side of the same corpus. Used two ways in
a training config's ``[data] synthetic`` (``model.training.config``): sequence-level knowledge
distillation (the teacher's output as the target of the same source) and back-translation (the
reverse model's output as the source of a human target). Decoding follows the model card
(beam size, length penalty) unless ``--beam-size`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from model import checkpoint
from model.engine import loading
from model.engine.allocator import tune_malloc
from model.engine.translator import Translator
from model.training.data import read_lines, write_lines
from model.training.evaluate import translate_all

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", required=True, type=Path, help="checkpoint folder (one direction)")
    parser.add_argument("--src", required=True, type=Path, help="source sentences (plain or .gz)")
    parser.add_argument("--out", required=True, type=Path, help="translations, one per line (.gz: gzip)")
    parser.add_argument("--beam-size", type=int, help="default: the model card's")
    parser.add_argument("--batch-size", type=int, default=128, help="sentences per batch (approx.)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--limit", type=int, help="only the first N sentences")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    tune_malloc()
    ckpt = loading.load(args.weights, args.device)
    served = checkpoint.directions(ckpt.meta)
    if len(served) != 1:
        parser.error(f"{args.weights} serves {len(served)} directions: give a one-direction checkpoint")
    src = read_lines(args.src)[: args.limit] if args.limit else read_lines(args.src)
    options = loading.decoding_options(ckpt.meta, args.beam_size)
    start = time.perf_counter()
    hyps = translate_all(Translator(ckpt.model, ckpt.tokenizer), src, options, args.batch_size)
    seconds = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_lines(args.out, hyps)
    direction = "-".join(served[0])
    summary = {"out": str(args.out), "direction": direction, "sentences": len(hyps), "seconds": round(seconds, 1)}
    print(json.dumps({**summary, "beam_size": options.beam_size, "length_penalty": options.length_penalty}))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
