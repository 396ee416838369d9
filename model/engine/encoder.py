"""The encoder at inference, for the sentences a decoding session admits: ``EncoderPass``, the
network's encoder math with its weights bound once (``model.engine.binding``), the operations
between its products from ``layer_ops`` (the fused kernels' or torch's), each layer written
once; where every product runs on packed panels (post-LN), the whole stack is one call of the
fused kernels, over the sentences' tokens alone (``_unpadded``)."""

from __future__ import annotations

import itertools
import math

import torch

from model.engine.binding import BoundEncoderLayer, Norm, few_rows_of, fused_kernels, panel_stack
from model.engine.layer_ops import layer_ops
from model.network.linear import uses_kernels
from model.network.masks import padding_mask
from model.network.transformer import Transformer

# The encoder's activations grow with the batch (the feed-forward layer's alone are B x S x 4D
# floats, and int8's fbgemm linear allocates an int32 accumulator as large beside its output), and
# the heap holes they leave grow the process at every longer batch: groups of at most this many
# padded positions bound them at a small cost in speed (docs/benchmarks/README.md#encoder-chunk).
ENCODER_CHUNK_TOKENS = 1024


class EncoderPass:
    """A model's encoder at inference, weights bound to their kernels once: the same math as
    ``Transformer.encode`` (the same attention function, so the same numbers; on the fused
    kernels' attention and joins, the same to float rounding), without the module calls around
    it. A decoding session encodes every sentence that joins it, a few at a time under
    continuous batching, where the modules' per-call overhead was a sixth of the encoder's time
    (docs/benchmarks/README.md#event-loop). Inference only: no dropout, and
    weights must not change while it is used; where the linear layers do not run on their
    kernels (``uses_kernels``: a GPU, autograd, autocast), it takes the modules' path,
    as ``DecoderStep`` does."""

    def __init__(self, model: Transformer) -> None:
        cfg = model.config
        self.model = model
        self.heads, self.pad_id, self.norm_first = cfg.n_heads, cfg.pad_id, cfg.norm_first
        fast = uses_kernels(model.device)
        # the fused kernels' attention, post-LN joins and small products where the decoder step
        # has them: at one sentence the encoder's SDPA, head permutes, adds and norms cost a third
        # of its time (docs/benchmarks/README.md#linear-kernels), and MKL runs its products
        # of a few sentences' rows far below its peak ("Packed panels")
        self.fused = fused_kernels(model, fast)
        few = few_rows_of(model, self.fused)
        self.layers = [BoundEncoderLayer.of(layer, fast, few) for layer in model.encoder_layers]
        self.final_norm = None if model.encoder_norm is None else Norm.of(model.encoder_norm)
        self.scale = 1.0 / math.sqrt(cfg.d_model // cfg.n_heads)
        self.ops = layer_ops(self.fused, cfg.n_heads, cfg.d_model // cfg.n_heads)
        # where every product runs on packed panels, all layers in one call
        self.stack = panel_stack(self.fused, "EncoderLayerWeights", [
            (dict(qkv=layer.self_attn.qkv, out=layer.self_attn.out, fc1=layer.ff.fc1, fc2=layer.ff.fc2),
             dict(attn_norm=layer.attn_block.norm, ff_norm=layer.ff_block.norm))
            for layer in model.encoder_layers
        ], cfg)  # fmt: skip

    def __call__(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src: (B, S) ids -> memory (B, S, D), source mask (B, 1, 1, S). Sentences go through
        the layers in groups of at most ``ENCODER_CHUNK_TOKENS`` padded positions (at least one
        sentence), each group's output written into the batch's memory; where every layer runs
        in one call of the fused kernels (``stack``), their tokens alone (``_unpadded``)."""
        mask = padding_mask(src, self.pad_id)
        b, s = src.shape
        if self.stack is not None:
            return self._unpadded(src, mask), mask
        per = max(1, ENCODER_CHUNK_TOKENS // max(s, 1))
        if b <= per:
            return self._encode(src, mask), mask
        first = self._encode(src[:per], mask[:per])
        memory = first.new_empty(b, s, first.shape[-1])
        memory[:per] = first
        del first
        for start in range(per, b, per):
            memory[start : start + per] = self._encode(src[start : start + per], mask[start : start + per])
        return memory, mask

    def _unpadded(self, src: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """src (B, S) ids, mask (B, 1, 1, S) -> memory (B, S, D), zeros at padded positions. The
        sentences' tokens go through the layers end to end, without their padding (the fused
        kernels' ``encoder_layers_ragged``): sentences that join a running batch a few at a time
        are as long as chance makes them, and test_2016 in groups of four padded to their longest
        is 39% padding (sorted batches of 64: 8%) that the products would compute for nothing
        (docs/benchmarks/README.md#encoder-chunk). Groups of whole sentences of at most
        ``ENCODER_CHUNK_TOKENS`` tokens, as the padded path's."""
        fused = self.fused
        assert fused is not None and self.stack is not None
        b, s = src.shape
        tokens = mask.reshape(-1).nonzero()[:, 0]  # (T,) the tokens' places in (B, S) order
        x = self.ops.embed_source(src, self.model.src_embed, tokens)  # (T, D)
        lengths = mask.reshape(b, s).sum(1).tolist()
        params, eps = self.stack
        memory = x.new_zeros(b * s, x.shape[1])
        start = first = 0
        while first < b:  # whole sentences, at most ENCODER_CHUNK_TOKENS tokens (at least one sentence)
            last, stop = first + 1, start + lengths[first]
            while last < b and stop + lengths[last] - start <= ENCODER_CHUNK_TOKENS:
                stop += lengths[last]
                last += 1
            offsets = torch.tensor([0, *itertools.accumulate(lengths[first:last])])
            y = fused.encoder_layers_ragged(x[start:stop], params, offsets, self.heads, self.scale, eps)
            memory.index_copy_(0, tokens[start:stop], y if self.final_norm is None else self.final_norm(y))
            start, first = stop, last
        return memory.view(b, s, -1)

    def _encode(self, src: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """src: (B, S) ids, mask (B, 1, 1, S) -> memory (B, S, D), all sentences at once."""
        b, s = src.shape
        x = self.ops.embed_source(src, self.model.src_embed)  # (B*S, D)
        d = x.shape[1]
        if self.stack is not None:
            params, eps = self.stack
            assert self.fused is not None
            x = self.fused.encoder_layers(x, params, mask.reshape(b, s).contiguous(), self.heads, self.scale, eps)
        else:
            x = self._layers(x, mask, b, s)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x.view(b, s, d)

    def _layers(self, x: torch.Tensor, mask: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """x (B*S, D) through every layer -> (B*S, D); mask (B, 1, 1, S)."""
        ops, post = self.ops, not self.norm_first
        for layer in self.layers:
            qkv = layer.qkv(x if post else layer.attn_norm(x), False)  # (B*S, 3D)
            x = ops.join(x, layer.out(ops.encoder_attention(qkv, mask, b, s), False), layer.attn_norm, post)
            x = ops.join(x, layer.ff(x if post else layer.ff_norm(x)), layer.ff_norm, post)
        return x
