"""Turn an ``AttentionResult`` into the /attention payload: filter, merge to words, align, round."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from app.serving.errors import BAD_REQUEST, ApiError
from model.engine.translator import AttentionResult

KINDS = ("cross", "encoder", "decoder")
SPECIALS = frozenset(["<s>", "</s>"])


@dataclass(frozen=True)
class Selection:
    layers: list[int]
    heads: list[int]
    kinds: list[str]
    level: str


def select(
    layers: Sequence[int] | None,
    heads: Sequence[int] | None,
    kinds: Sequence[str] | None,
    level: str,
    n_layers: int,
    n_heads: int,
) -> Selection:
    """Validate the filters (400 on out-of-range or repeated indices)."""
    chosen_layers = list(range(n_layers)) if layers is None else list(layers)
    chosen_heads = list(range(n_heads)) if heads is None else list(heads)
    for name, values, limit in (("layers", chosen_layers, n_layers), ("heads", chosen_heads, n_heads)):
        if not values:
            raise ApiError(BAD_REQUEST, "validation_error", f"{name}: give at least one index or leave it out")
        if len(set(values)) != len(values) or any(not 0 <= v < limit for v in values):
            raise ApiError(BAD_REQUEST, "validation_error", f"{name}: distinct indices in 0..{limit - 1} expected")
    chosen_kinds = list(KINDS) if kinds is None else list(dict.fromkeys(kinds))
    if not chosen_kinds:
        raise ApiError(BAD_REQUEST, "validation_error", "kinds: give at least one of cross, encoder, decoder")
    return Selection(chosen_layers, chosen_heads, chosen_kinds, level)


def _tokens(pieces: Sequence[str], level: str) -> tuple[list[str], list[list[int]]]:
    if level == "word":
        from model.network.attention_words import merge_pieces

        return merge_pieces(list(pieces))
    return list(pieces), [[i] for i in range(len(pieces))]


def _axes(result: AttentionResult, sel: Selection) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """The token lists (source, target, target input) and each kind's (query, key) groups."""
    src, src_groups = _tokens(result.source, sel.level)
    tgt, tgt_groups = _tokens(result.target, sel.level)
    tgt_in, tgt_in_groups = _tokens(result.target_input, sel.level)
    axes = {
        "cross": (tgt_groups, src_groups),
        "encoder": (src_groups, src_groups),
        "decoder": (tgt_groups, tgt_in_groups),
    }
    return {"source_tokens": src, "target_tokens": tgt, "target_input_tokens": tgt_in}, axes


def check_size(result: AttentionResult, sel: Selection, max_cells: int) -> None:
    """400 ``payload_too_large`` when the selection holds more than ``max_cells`` values (no
    tensor work: the event loop calls it before ``build`` runs on the model thread)."""
    _check_cells(_axes(result, sel)[1], sel, max_cells)


def _check_cells(axes: dict[str, tuple[Any, Any]], sel: Selection, max_cells: int) -> None:
    cells = sum(len(sel.layers) * len(sel.heads) * len(axes[k][0]) * len(axes[k][1]) for k in sel.kinds)
    if cells > max_cells:
        raise ApiError(
            BAD_REQUEST,
            "payload_too_large",
            f"{cells} attention values requested (limit {max_cells}); "
            "ask for fewer layers, heads or kinds, or a shorter text",
        )


def build(result: AttentionResult, sel: Selection, max_cells: int) -> dict[str, Any]:
    """Maps per kind as nested lists [layer][head][query][key] (4 decimals) plus the alignment.
    Tensor work: the service runs it on the model thread (``TranslationService.on_model_thread``)."""
    tokens, axes = _axes(result, sel)
    _check_cells(axes, sel, max_cells)
    src, tgt = tokens["source_tokens"], tokens["target_tokens"]
    layer_idx, head_idx = torch.tensor(sel.layers), torch.tensor(sel.heads)
    maps: dict[str, torch.Tensor] = {}
    for kind in set(sel.kinds) | {"cross"}:
        full: torch.Tensor = getattr(result, kind)  # (L, H, Q, K)
        chosen = full.index_select(0, layer_idx).index_select(1, head_idx)
        queries, keys = axes[kind]
        if sel.level == "word":
            from model.network.attention_words import merge_map

            chosen = merge_map(chosen, queries, keys)
        maps[kind] = chosen
    attention = {k: maps[k].double().round(decimals=4).tolist() for k in sel.kinds}  # float64: 0.2584, not 0.25839999
    return {
        **tokens,
        "layers": sel.layers,
        "heads": sel.heads,
        "attention": attention,
        "alignment": alignment(maps["cross"], src, tgt),
    }


def alignment(cross: torch.Tensor, src: list[str], tgt: list[str]) -> list[dict[str, Any]]:
    """For each target token, the source token it attends to most (mean over the chosen
    layers and heads), ignoring end-of-sentence tokens. cross: (L, H, T, S)."""
    mean = cross.float().mean(dim=(0, 1))  # (T, S)
    keep = torch.tensor([t not in SPECIALS for t in src])
    if not bool(keep.any()):
        return []
    mean = mean.masked_fill(~keep, -1.0)
    weight, best = mean.max(dim=1)
    return [
        {
            "target_index": i,
            "source_index": int(best[i]),
            "target_token": tok,
            "source_token": src[int(best[i])],
            "weight": round(float(weight[i]), 4),
        }
        for i, tok in enumerate(tgt)
        if tok not in SPECIALS
    ]
