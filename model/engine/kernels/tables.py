"""The token table the embedding lookups read: the float rows, or, for a tied output projection
that runs on the fused kernels' panels, those panels themselves.

A tied model's token table is its output projection. Where that projection runs on a packed copy
(``PackedPanels``, ``PackedInt8Panels``), keeping the float rows beside it for the lookups would
hold the vocabulary twice: 119 MiB more at OPUS-MT's 58k x 512. The lookups then read the packed
copy instead (``TokenTable``): the float32 panels exactly, or the int8 panels dequantized row by
row, as CTranslate2 keeps an int8 model's embeddings. The fused kernels' ``embed`` reads all three
layouts; ``TokenTable.__call__`` is the same lookup in tensor operations (the network's modules,
the engine's tensor path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.engine.kernels.int8_panel_ops import PackedInt8Panels
from model.engine.kernels.panel_ops import PackedPanels
from model.network.transformer import Embedding, Transformer

NO_SCALES = torch.empty(0)


@dataclass(frozen=True, eq=False)
class TokenTable:
    """A token table in one of three layouts (``data``): rows (V, D) float32 or float16; the
    fused kernels' float32 panels (ceil(V / W), D, W); or their int8 panels (ceil(V / 16), D / 4,
    16, 4) with ``scales`` (V rounded up to 16,) float32 (empty for the float layouts)."""

    data: torch.Tensor
    scales: torch.Tensor = NO_SCALES

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (...) int64 -> their rows (..., D) float32 (a float16 table's rows as float16:
        ``Embedding.forward`` converts them)."""
        data = self.data
        if data.dim() == 2:
            return F.embedding(ids, data)
        flat = ids.reshape(-1)
        width = data.shape[2]
        rows = data[flat // width, :, flat % width]  # (R, D) or, int8, (R, D / 4, 4)
        if data.dim() == 4:
            rows = rows.reshape(flat.shape[0], -1).float() * self.scales[flat, None]
        return rows.reshape(*ids.shape, rows.shape[-1])

    @property
    def width(self) -> int:
        """D, the rows' width."""
        return self.data.shape[1] * (4 if self.data.dim() == 4 else 1)


def token_table(embedding: Embedding) -> TokenTable:
    """What ``embedding``'s lookups read: the table its ``lookup`` holds where the engine gave it
    one, else its token rows."""
    lookup = embedding.lookup
    return lookup if isinstance(lookup, TokenTable) else TokenTable(embedding.tokens.weight)


def output_table(model: Transformer) -> TokenTable | None:
    """The output projection's rows as a table (a shortlist gathers them): its float matrix, or
    the packed copy that replaced it (``packed_table``); None where neither can be read."""
    matrix = model.output_matrix()
    return TokenTable(matrix) if not matrix.is_meta else packed_table(model.kernel)


def packed_table(kernel: object) -> TokenTable | None:
    """The token table a tied output projection's packed ``kernel`` holds (its panels), or None
    where the lookups cannot read it (fbgemm's or oneDNN's packing)."""
    if isinstance(kernel, PackedPanels):
        return TokenTable(kernel.panels)
    if isinstance(kernel, PackedInt8Panels):
        return TokenTable(kernel.panels, kernel.scales)
    return None


def unpacked_rows(kernel: PackedPanels) -> torch.Tensor:
    """A ``PackedPanels`` kernel's weight as rows (out, in) float32 again, exactly (the panels are
    a layout, not a rounding): for what reads rows (a shortlist's gathered columns)."""
    panels = kernel.panels  # (P, K, W)
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[: kernel.out_features].contiguous()
