"""Write a randomly initialised checkpoint with the same architecture and tokenizer as another.

    python -m bench.random_weights --like weights/de-en --out /tmp/random-de-en [--seed 0]

For speed measurements that must not depend on what a model learned (the cache versus
the naive decoder on "the same random-initialized model"). The output is a normal
checkpoint folder, so every benchmark system loads it like the shipped one.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from model import checkpoint
from model.engine import loading
from model.network.transformer import Transformer

log = logging.getLogger(__name__)


def random_like(like: Path, out: Path, seed: int = 0) -> Path:
    """A checkpoint at ``out`` with ``like``'s config, tokenizer and metadata, Xavier-random weights."""
    source = loading.load(like, "cpu", keep_float_weights=True)
    torch.manual_seed(seed)
    model = Transformer(source.config)
    meta = {k: v for k, v in source.meta.items() if k not in {"training", "model"}}
    return checkpoint.save(out, model, source.tokenizer, {**meta, "random_init_seed": seed})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", type=Path, default=Path("weights/de-en"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    log.info("wrote %s", random_like(args.like, args.out, args.seed))


if __name__ == "__main__":
    main()
