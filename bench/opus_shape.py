"""A random-weight checkpoint of OPUS-MT's shape, for speed at the size people deploy.

    python -m bench.opus_shape --out /tmp/opus-shape [--vocab 58101] [--activation relu|swish]

Transformer-base as OPUS-MT's models are: d_model 512, 8 heads, 6 + 6 layers, d_ff 2048, a
58,101-piece joint vocabulary (OPUS-MT en-de's), scaled embeddings, post-LN, sinusoidal
positions. The tokenizer is the shipped de-en sentencepiece model with pieces appended to reach
the vocabulary size (never chosen by its segmentation: their scores are far below every real
piece's), so the sources are cut as the shipped model cuts them and the output projection is
58k wide. The folder is an ordinary checkpoint: ``bench.decode --weights`` runs it on every system.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from sentencepiece import sentencepiece_model_pb2

from model import checkpoint
from model.network.config import ModelConfig
from model.network.tokenizer import Tokenizer
from model.network.transformer import Transformer

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]


def widened(tokenizer: Tokenizer, size: int) -> Tokenizer:
    """``tokenizer`` with unused pieces appended up to ``size`` pieces."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tokenizer.model_proto)
    low = min(p.score for p in proto.pieces) - 100.0
    for i in range(len(proto.pieces), size):
        piece = proto.pieces.add()
        piece.piece, piece.score = f"\u2581\u2400{i}", low
    return Tokenizer(proto.SerializeToString())


def opus_shaped(out: Path, vocab: int = 58101, activation: str = "relu", seed: int = 0, **shape: int) -> Path:
    """The checkpoint at ``out``; ``shape`` overrides the sizes (a smaller one for tests)."""
    tokenizer = widened(Tokenizer.load(ROOT / "weights" / "de-en" / "spm.model"), vocab)
    sizes = {"d_model": 512, "n_heads": 8, "encoder_layers": 6, "decoder_layers": 6, "d_ff": 2048, **shape}
    config = ModelConfig(
        src_vocab_size=vocab, tgt_vocab_size=vocab, dropout=0.0, attention_dropout=0.0,
        activation=activation, **sizes,  # type: ignore[arg-type]
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Transformer(config)
    meta = {"source_lang": "de", "target_lang": "en", "decoding": {"beam_size": 4, "length_penalty": 0.6},
            "random_init_seed": seed, "shape": "OPUS-MT transformer-base"}  # fmt: skip
    return checkpoint.save(out, model, tokenizer, meta)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab", type=int, default=58101)
    parser.add_argument("--activation", default="relu", choices=("relu", "swish"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    log.info("wrote %s", opus_shaped(args.out, args.vocab, args.activation))


if __name__ == "__main__":
    main()
