"""The tutorials' decoder: one sentence at a time, greedy, no KV cache.

At every step the whole target prefix goes through the decoder again (``Transformer.decode``,
which also re-projects the encoder memory to cross-attention K/V in each layer), and only
the last position's logits are used. The encoder runs once per sentence. This is the
baseline for "what does the cache (and batching) buy"; outputs equal our greedy search's
up to floating-point ties, since the function computed is the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.engine.decoding import max_steps
from model.engine.options import DecodingOptions
from model.network.tokenizer import Tokenizer
from model.network.transformer import Transformer


@torch.inference_mode()
def greedy_ids(model: Transformer, src_ids: Sequence[int], options: DecodingOptions) -> list[int]:
    """src_ids: one sentence's pieces (no EOS) -> generated ids without BOS/EOS.

    The length limit is ``model.engine.decoding.max_steps``'s, so it stops where our search stops.
    """
    cfg = model.config
    device = model.device
    src = torch.tensor([[*src_ids, cfg.eos_id]], device=device)  # (1, S)
    memory, mask, _ = model.encode(src)  # (1, S, D), (1, 1, 1, S)
    limit = max_steps([src.shape[1]], options, cfg.max_tokens)[0]
    out = [cfg.bos_id]
    for _ in range(limit):
        tgt = torch.tensor([out], device=device)  # (1, t): the whole prefix, every step
        logits, _, _ = model.decode(tgt, memory, mask)  # (1, t, V)
        token = int(logits[0, -1].argmax())
        if token == cfg.eos_id:
            break
        out.append(token)
    return out[1:]


def translate(
    model: Transformer, tokenizer: Tokenizer, texts: Sequence[str], options: DecodingOptions
) -> list[list[int]]:
    """Texts -> generated ids per sentence (greedy; ``options.beam_size`` is ignored)."""
    return [greedy_ids(model, ids, options) for ids in tokenizer.encode(texts)]
