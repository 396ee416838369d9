"""Does ``torch.compile`` (inductor, CPU) speed up the small-batch decoder step?

    python -m bench.compile_step [--weights weights/de-en] [--rows 1,4] [--steps 15] [--reps 40]

``model.engine.step.DecoderStep`` writes into views of its cache's buffers, which inductor cannot
compile (docs/benchmarks/README.md#fused-step). So this times a functional twin of the
same math that inductor can take whole: a static KV cache (``--slots`` positions laid out up
front, the unused ones hidden by an additive mask, new keys and values written with
``index_copy_``), the checkpoint's float32 weights as plain tensors, and one graph per row
count (``dynamic=False``: 1 row is a greedy sentence, 4 a beam-4 one), frozen weights
(``torch._inductor.config.freezing``) so inductor packs the linear layers itself.

Before timing, the eager twin is checked against the network's own teacher-forced decoder
(``Transformer.decode``) on one sentence; the compiled step is checked against the eager one
on the same inputs. One JSON line per row count: milliseconds per step eager and compiled,
the first compiled pass (compilation included) in seconds, the largest difference between
the compiled and eager logits, and for comparison the engine's own time per step on the same
sentence (``Translator.decode_batch`` of the served float32 model, packed kernels, greedy for
1 row and beam search of that width otherwise, its bookkeeping and the sentence's encoder pass
included: ``engine_ms``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

from model.engine import allocator, loading
from model.engine.translator import Translator, source_batch
from model.network.transformer import Transformer

StepFn = Callable[..., torch.Tensor]


def functional_step(model: Transformer) -> StepFn:
    """The decoder step of ``model`` as one function of tensors (weights captured, float32).

    step(tokens (R,), pos (1,) long, keys/values: per layer (R, H, slots, Dh) written at ``pos``,
    cross_keys/cross_values: per layer (R, H, S, Dh), slot_bias (1, 1, 1, slots): 0 up to ``pos``,
    -inf after) -> logits (R, V)."""
    cfg = model.config
    heads, d = cfg.n_heads, cfg.d_model
    dh = d // heads

    def t(x: torch.Tensor) -> torch.Tensor:
        return x.detach().float().contiguous()

    layers = []
    for layer in model.decoder_layers:
        sa, ca, ff = layer.self_attn, layer.cross_attn, layer.ff
        linears = [
            (t(m.weight), None if m.bias is None else t(m.bias)) for m in (sa.qkv, sa.out, ca.q, ca.out, ff.fc1, ff.fc2)
        ]
        norms = [
            (t(n.weight), t(n.bias), n.eps)
            for n in (layer.self_block.norm, layer.cross_block.norm, layer.ff_block.norm)
        ]
        layers.append((linears, norms))
    embed = model.tgt_embed
    tokens_w, scale = t(embed.tokens.weight), embed.scale
    table = embed.learned.weight if embed.learned is not None else embed.table
    assert table is not None
    positions = t(table)
    output = t(model.output_matrix())
    final = (
        None
        if model.decoder_norm is None
        else (t(model.decoder_norm.weight), t(model.decoder_norm.bias), model.decoder_norm.eps)
    )
    pre = cfg.norm_first

    def norm(x: torch.Tensor, n: tuple[torch.Tensor, torch.Tensor, float]) -> torch.Tensor:
        return F.layer_norm(x, (d,), n[0], n[1], n[2])

    def step(
        tokens: torch.Tensor,
        pos: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        cross_keys: list[torch.Tensor],
        cross_values: list[torch.Tensor],
        slot_bias: torch.Tensor,
    ) -> torch.Tensor:
        r = tokens.shape[0]
        x = F.embedding(tokens, tokens_w) * scale + positions[pos]
        for i, ((qkv, out, cq, cout, fc1, fc2), (n1, n2, n3)) in enumerate(layers):
            # self-attention (post-LN: norm after the residual; pre-LN: before the sublayer)
            h = norm(x, n1) if pre else x
            q, k, v = F.linear(h, *qkv).view(r, 3, heads, dh).unbind(1)
            keys[i].index_copy_(2, pos, k.unsqueeze(2))
            values[i].index_copy_(2, pos, v.unsqueeze(2))
            a = F.scaled_dot_product_attention(q.unsqueeze(2), keys[i], values[i], attn_mask=slot_bias)
            x = x + F.linear(a.reshape(r, d), *out) if pre else norm(x + F.linear(a.reshape(r, d), *out), n1)
            # cross-attention
            h = norm(x, n2) if pre else x
            q = F.linear(h, *cq).view(r, heads, 1, dh)
            a = F.scaled_dot_product_attention(q, cross_keys[i], cross_values[i])
            x = x + F.linear(a.reshape(r, d), *cout) if pre else norm(x + F.linear(a.reshape(r, d), *cout), n2)
            # feed-forward
            h = norm(x, n3) if pre else x
            y = F.linear(F.relu(F.linear(h, *fc1)), *fc2)
            x = x + y if pre else norm(x + y, n3)
        if final is not None:
            x = norm(x, final)
        return F.linear(x, output)

    return step


class StaticCache:
    """The step's inputs for ``rows`` rows: self-attention buffers of ``slots`` positions and
    cross-attention K/V of one source's encoder memory (1, S, D), repeated per row, as
    ``functional_step`` takes them."""

    def __init__(self, model: Transformer, memory: torch.Tensor, rows: int, slots: int) -> None:
        cfg = model.config
        heads, dh, n = cfg.n_heads, cfg.d_model // cfg.n_heads, len(model.decoder_layers)
        kv = model.project_memory(memory)  # per layer (1, H, S, Dh) each
        self.cross_keys = [k.expand(rows, -1, -1, -1).contiguous() for k, _ in kv]
        self.cross_values = [v.expand(rows, -1, -1, -1).contiguous() for _, v in kv]
        self.keys = [torch.zeros(rows, heads, slots, dh) for _ in range(n)]
        self.values = [torch.zeros(rows, heads, slots, dh) for _ in range(n)]
        self.bias = torch.full((1, 1, 1, slots), float("-inf"))

    def run(self, step: StepFn, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` (R, T) one position per step from an empty cache -> logits (R, T, V)."""
        self.bias.fill_(float("-inf"))
        out = []
        for i in range(tokens.shape[1]):
            self.bias[..., i] = 0.0
            pos = torch.tensor([i])
            out.append(step(tokens[:, i], pos, self.keys, self.values, self.cross_keys, self.cross_values, self.bias))
        return torch.stack(out, dim=1)


def per_step_ms(cache: StaticCache, step: StepFn, tokens: torch.Tensor, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        cache.run(step, tokens)
    return (time.perf_counter() - start) / (reps * tokens.shape[1]) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, default=Path("weights/de-en"))
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--steps", type=int, default=15, help="decoder steps per pass (a typical sentence's)")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--slots", type=int, default=64, help="positions of the static self-attention cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpp-wrapper", action="store_true", help="inductor's C++ wrapper instead of Python's")
    args = parser.parse_args(argv)
    allocator.bound_onednn_cache()
    allocator.tune_malloc()
    torch.set_num_threads(args.threads)
    ckpt = loading.load(args.weights, "cpu", "float32", keep_float_weights=True)
    model = ckpt.model
    cfg = model.config
    step = functional_step(model)
    text = "Ein Mann in einem blauen Hemd steht auf einer Leiter und putzt ein Fenster."
    tokens = torch.randint(
        4, model.output_matrix().shape[0], (1, args.steps), generator=torch.Generator().manual_seed(0)
    )
    tokens[0, 0] = cfg.bos_id
    inductor_config.freezing = True
    inductor_config.cpp_wrapper = args.cpp_wrapper
    compiled = torch.compile(step, dynamic=False)
    served = loading.load(args.weights, "cpu", "float32")  # the engine as the service runs it
    engine = Translator(served.model, served.tokenizer)
    ids = engine.encode([text])  # one sentence's ids, no specials
    src = source_batch(model, ids)  # (1, S), EOS-ended
    with torch.inference_mode():
        memory, mask, _ = model.encode(src)
        reference, _, _ = model.decode(tokens, memory, mask)  # (1, T, V)
        twin = StaticCache(model, memory, 1, args.slots).run(step, tokens)
        eager_error = (twin - reference).abs().max().item()
        for rows in (int(r) for r in args.rows.split(",")):
            batch = tokens.expand(rows, -1)
            cache = StaticCache(model, memory, rows, args.slots)
            eager_logits = cache.run(step, batch)
            start = time.perf_counter()
            compiled_logits = cache.run(compiled, batch)
            first = time.perf_counter() - start  # (both are warm now: eager ran first)
            options = loading.decoding_options(served.meta, rows)
            for _ in range(3):
                engine.decode_batch(ids, options)
            start, engine_steps = time.perf_counter(), 0
            for _ in range(args.reps):
                engine_steps += engine.decode_batch(ids, options).steps
            engine_ms = (time.perf_counter() - start) / engine_steps * 1e3
            row = {
                "rows": rows,
                "steps": args.steps,
                "eager_ms": round(per_step_ms(cache, step, batch, args.reps), 3),
                "compiled_ms": round(per_step_ms(cache, compiled, batch, args.reps), 3),
                "eager_again_ms": round(per_step_ms(cache, step, batch, args.reps), 3),
                "engine_ms": round(engine_ms, 3),
                "first_compiled_pass_s": round(first, 1),
                "compiled_vs_eager_max_diff": float(f"{(compiled_logits - eager_logits).abs().max().item():.3g}"),
                "eager_vs_model_max_diff": float(f"{eager_error:.3g}"),
                "cpp_wrapper": args.cpp_wrapper,
                "threads": args.threads,
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
