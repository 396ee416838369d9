"""A checkpoint folder made ready for inference: the linear kernels this CPU and precision run
(``kernels.choose``, ``kernels.install``), float weights released where packed copies replace
them, the lexical shortlist where it pays, and a request's decoding options on top of the model
card's. ``model.checkpoint`` reads the folder; this module decides how it runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from model import checkpoint
from model.checkpoint import CheckpointError, load_metadata, recommended_decoding
from model.engine import kernels, shortlist
from model.engine.features import CpuFeatures
from model.engine.kernels import KernelPlan
from model.engine.options import DecodingOptions, Repetition
from model.engine.shortlist import Shortlist
from model.network.config import ModelConfig
from model.network.tokenizer import Tokenizer, target_prefix
from model.network.transformer import Embedding, Transformer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: the network (eval mode), its tokenizer and config.json's content."""

    model: Transformer
    tokenizer: Tokenizer
    meta: dict[str, Any]
    path: Path
    plan: KernelPlan

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def source_prefix(self, target: str) -> tuple[int, ...]:
        """What leads every source translated into ``target``: a many-to-many model's target
        tag (``target_prefix``), nothing for a one-direction model."""
        return target_prefix(self.tokenizer, target) if self.meta.get("target_tags") else ()


def decoding_options(
    meta: dict[str, Any],
    beam_size: int | None = None,
    n_best: int = 1,
    max_length: int | None = None,
    direction: str | None = None,
    repetition: Repetition | None = None,
) -> DecodingOptions:
    """A request's options on top of the model card's recommended decoding (config.json
    "decoding": beam, length penalty, length limits; ``recommended_decoding`` for ``direction``
    "src-tgt"; its ``repetition_penalty`` and ``no_repeat_ngram_size`` unless ``repetition`` sets
    them): the one place both the service and ``model.training.evaluate`` build them. ``n_best``
    hypotheses come from one beam, so a narrower beam is widened to ``n_best``. Raises
    ``ValueError`` for options no search can run."""
    card = recommended_decoding(meta, direction)
    beam = max(beam_size if beam_size is not None else int(card.get("beam_size", 4)), n_best)
    card.update(beam_size=beam, n_best=n_best, max_length=max_length)
    if repetition is not None:
        card.update(repetition.given())
    return DecodingOptions(**card)


def load(
    path: str | Path,
    device: str | torch.device = "cpu",
    precision: str = "float32",
    features: CpuFeatures | None = None,
    keep_float_weights: bool = False,
    fused: bool | None = None,
) -> Checkpoint:
    """Load and validate a checkpoint folder onto ``device`` for inference at ``precision``
    (float32, bfloat16, float16 or int8; eval mode), with the linear kernels ``kernels.choose``
    picks for it and this CPU (or ``features``). Layers that run on packed copies (int8, float32
    on oneDNN, float32 on the fused kernels' panels: a plan on ``panels``) give their float
    weights up (``kernels.release_float_weights``; the output projection too, a tied one's
    lookups then reading its packed copy or a float16 table: ``release_output_projection``), so
    the model is for inference only; ``keep_float_weights``
    keeps them (converters and tools that read the weights). ``fused``: whether the decoder step
    runs the fused kernels (``model.engine.fused``; default ``TRANSLATOR_FUSED_STEP``, on). Raises
    ``kernels.UnsupportedPrecision`` before reading anything when the precision cannot run here."""
    plan = kernels.choose(device, precision, features, fused=fused)
    folder = checkpoint.read(path)
    model, tokenizer, meta, path = folder.model, folder.tokenizer, folder.meta, folder.path
    model.to(device=device, dtype=plan.dtype).eval()
    kernels.install(model, plan, model.step_linears())
    if plan.kernel == "panels" and model.fused_step is None:  # a compiler, but the kernels did not build (logged)
        plan = kernels.choose(device, precision, features, fused=False)
        kernels.install(model, plan, model.step_linears())
    # the packed copies are all the layers read: one copy of their weights, not two
    panels = kernels.panel_kernels(plan) if model.fused_step is not None else None
    int8 = kernels.int8_kernels(plan) if model.fused_step is not None else None  # (int8 on the kernels' panels)
    if (plan.kernel in ("fbgemm-int8", "onednn") or panels is not None) and not keep_float_weights:
        released = kernels.release_float_weights(model, keep=[model.output_matrix()], panels=panels, int8=int8)
        released += release_output_projection(model, panels, int8)
        if released:
            log.info("%s: released %.1f MiB of float weights that packed copies replace", precision, released / 2**20)
    log.info("loaded %s (%d parameters): %s", path, model.num_parameters(), plan.describe())
    return Checkpoint(model, tokenizer, meta, path, plan)


def load_shortlist(path: str | Path, vocab_size: int) -> Shortlist | None:
    """A checkpoint folder's shortlist, or None where it has none; raises ``CheckpointError``
    for a file that does not match the vocabulary."""
    file = Path(path) / shortlist.FILE
    if not file.is_file():
        return None
    try:
        tensors = load_file(str(file))
        offsets, targets, always = tensors["offsets"].long(), tensors["targets"], tensors["always"].long()
        per_source = int(load_metadata(file)["per_source"])
    except (SafetensorError, KeyError, OSError, ValueError) as err:
        raise CheckpointError(f"{file}: not a shortlist ({err})") from err
    ok = offsets.dim() == targets.dim() == always.dim() == 1 and offsets.numel() == vocab_size + 1
    ok = ok and not targets.is_floating_point() and int(offsets[0]) == 0 and int(offsets[-1]) == targets.numel()
    ok = ok and bool((offsets[1:] >= offsets[:-1]).all())
    if not ok or any(t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size) for t in (targets, always)):
        raise CheckpointError(f"{file}: does not match a vocabulary of {vocab_size} pieces")
    return Shortlist(offsets, targets, always, per_source)


def vocabulary_label(shortlist: Shortlist | None) -> str:
    """What decoding with ``shortlist`` (``use_shortlist``'s answer) scores, as /info,
    ``model.training.evaluate`` and the benchmarks report it: "shortlist" or "full" (every piece)."""
    return "full" if shortlist is None else "shortlist"


def use_shortlist(ckpt: Checkpoint, wanted: bool = True) -> Shortlist | None:
    """The shortlist decoding will use: the folder's, where ``wanted`` and it pays. int8 decodes
    the whole vocabulary: its output projection (int8 rows on fbgemm) costs less than the
    shortlist's float rows (docs/benchmarks/README.md#shortlist). Where one is returned, the
    whole-vocabulary projection leaves the decoding path (``shortlist_output``): decoding scores
    the rows the shortlist gathers from the token table, and only the rare teacher-forced pass
    (``/attention``) projects onto every piece. Call before decoding with the model."""
    if not wanted or ckpt.plan.precision == "int8" or ckpt.model.output_bias is not None:
        return None  # (a shortlist scores gathered rows without a bias: none for models with one)
    found = load_shortlist(ckpt.path, ckpt.config.tgt_vocab_size)
    device = ckpt.model.device
    if found is not None and device.type != "cpu":  # beside the model: a session reads it with the sources
        found = found.to(device)
    if found is not None:
        released = shortlist_output(ckpt.model)
        if released:
            log.info("%s: the shortlist reads the token table: %.1f MiB of output projection released",
                     ckpt.path, released / 2**20)  # fmt: skip
    return found


def shortlist_output(model: Transformer) -> int:
    """For decoding through a shortlist, a float32 CPU model with tied embeddings keeps its
    output projection once, as the token table the lookups and the shortlist's gathered rows
    read: a packed copy (``release_output_projection``) gives way to the float rows (the fused
    kernels' panels are unpacked back into them, exactly), the table is stored in float16 where
    that holds every value exactly, and the whole-vocabulary projection converts it per call
    (``kernels.upcast``: slower, for what seldom needs it). Untied models and other precisions
    are left as they are. -> bytes freed (7.8 MiB packed, 3.9 MiB of table, for 8,000 x 256)."""
    kernel, table = model.kernel, model.output_matrix()
    if model.output is not None or model.device.type != "cpu":
        return 0
    if isinstance(kernel, kernels.PackedPanels):  # the panels were the table: rows again, halved where exact
        rows = kernels.unpacked_rows(kernel)
        tokens = model.tgt_embed.tokens
        tokens.weight = nn.Parameter(rows, requires_grad=False)
        for embedding in _sharing(model, tokens):
            embedding.lookup = None
        freed = kernel.panels.numel() * kernel.panels.element_size() - rows.numel() * rows.element_size()
        freed += _half_token_tables(model)
    elif table.is_meta:
        return 0
    elif isinstance(kernel, kernels.PackedOneDNN):  # its table is float16 already, where exact
        freed = kernel.packed_weight.numel() * kernel.packed_weight.element_size()
    elif kernel is kernels.aten and table.dtype == torch.float32:
        freed = _half_token_tables(model)
    else:
        return 0
    model.kernel = kernels.upcast
    return freed


def _sharing(model: Transformer, tokens: nn.Embedding) -> list[Embedding]:
    """The model's embeddings (source, target) that look ``tokens`` up."""
    return [e for e in (model.src_embed, model.tgt_embed) if e.tokens is tokens]


def _half_token_tables(model: Transformer) -> int:
    """Keep the token tables in float16 where that holds every value exactly (weights shipped in
    float16 do); the lookups upcast the rows they read: the same numbers in half the memory.
    -> bytes released."""
    released = 0
    for tokens in {id(e.tokens): e.tokens for e in (model.src_embed, model.tgt_embed)}.values():
        table = tokens.weight
        if table.is_meta or not _half_exact(table):
            continue
        released += table.numel() * (table.element_size() - 2)
        tokens.weight = nn.Parameter(table.detach().half(), requires_grad=False)
    return released


def release_output_projection(
    model: Transformer, panels: ModuleType | None = None, int8: ModuleType | None = None
) -> int:
    """For inference on packed kernels (after ``kernels.release_float_weights``): the output
    projection runs on a packed copy of its own (``model.kernel``; ``panels``: the fused kernels'
    float32 panels, on a plan that names them; ``int8``: their int8 panels, where they take every
    int8 product), so its float matrix is read by nothing else when untied (released to a
    placeholder), and only by the token lookups when tied to the embeddings. Those then read, in
    this order: the fused kernels' float32 panels (the same numbers, no second copy); the
    embeddings in float16 where that holds every value exactly (weights shipped in float16 do),
    upcast row by row; the int8 panels, dequantized row by row as CTranslate2 reads an int8
    model's embeddings (a vocabulary-wide float32 copy otherwise: 119 MiB at 58k x 512, most of
    such a model's memory); else the float rows. The packed tables: ``kernels.tables``.
    -> bytes released."""
    out = model.output_matrix()
    packed = kernels.packed_kernel(model.kernel, out, model.output_bias, panels=panels, int8=int8)
    if packed is None:
        return 0
    model.kernel = packed
    placeholder = nn.Parameter(torch.empty_like(out, device="meta"), requires_grad=False)
    if model.output is not None:  # untied: the packed copy is its only reader
        model.output.weight = placeholder
        return out.numel() * out.element_size() + _half_token_tables(model)
    table = kernels.packed_table(packed)
    if table is not None and (isinstance(packed, kernels.PackedPanels) or not _half_exact(out)):
        tokens = model.tgt_embed.tokens
        for embedding in _sharing(model, tokens):
            embedding.lookup = table
        tokens.weight = placeholder
        return out.numel() * out.element_size() + _half_token_tables(model)
    return _half_token_tables(model)


def _half_exact(table: torch.Tensor) -> bool:
    return table.dtype == torch.float32 and torch.equal(table.half().float(), table)
