"""The token table read from the output projection's packed copy (``model.engine.kernels.tables``):
the fused kernels' ``embed`` and ``TokenTable``'s tensor lookup read every layout alike, and a
loaded model whose tied table lives only in those panels (float32 or int8, any vocabulary size,
with an output bias) decodes as the same model with its float rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model import checkpoint
from model.engine import fused, kernels, loading
from model.engine.features import detected, fused_variant, runnable_variants
from model.engine.kernels.tables import NO_SCALES, TokenTable
from model.engine.options import DecodingOptions
from model.engine.translator import Translator
from model.network.tokenizer import Tokenizer
from model.network.transformer import Transformer
from tests.factories import tiny_config
from tests.helpers import require

pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("fused_kernels")]

HERE = detected()


def _variants() -> list[object]:
    own = fused_variant(HERE)
    return [pytest.param(v, marks=() if v == own else pytest.mark.compile) for v in runnable_variants(HERE)]


def _quantized(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row, as fbgemm's weights: (V, D) int8 and scales (V,)."""
    scales = rows.abs().amax(dim=1) / 127
    return torch.round(rows / scales[:, None]).to(torch.int8), scales


@pytest.mark.parametrize("variant", _variants())
def test_embed_reads_rows_panels_and_int8_panels_as_the_lookup_does(variant: str) -> None:
    """A vocabulary of 61 pieces (no whole number of panels): the float32 panels give the rows
    exactly, the int8 panels each row's int8 values times its scale, and the kernels' ``embed``
    adds the positions to the same rows; tokens beyond the table and int8 panels without their
    scales are refused."""
    require(fused.load(variant) is not None, f"the fused step kernels ({variant}) do not build here: see the log")
    module = fused.load(variant)
    assert module is not None
    torch.manual_seed(0)
    v, d = 61, 32
    rows = torch.randn(v, d)
    q, scales = _quantized(rows)
    int8_panels, colsums = module.pack_int8(q)
    layouts = {
        "rows": TokenTable(rows),
        "float16 rows": TokenTable(rows.half()),
        "panels": TokenTable(module.pack_panels(rows)),
        "int8 panels": TokenTable(int8_panels, F.pad(scales, (0, colsums.shape[0] - v))),
    }
    ids = torch.tensor([0, 60, 5, 5, 33, 59, 1])
    want = {
        "rows": rows[ids],
        "float16 rows": rows.half()[ids],
        "panels": rows[ids],
        "int8 panels": q[ids].float() * scales[ids, None],
    }
    for name, table in layouts.items():
        assert torch.equal(table(ids), want[name]), name
        assert torch.equal(table(ids.view(7, 1)), want[name].view(7, 1, d)), name  # (B, T) ids
        for where in (torch.randn(d), torch.randn(7, d)):
            got = module.embed(ids, table.data, table.scales, where, 1.7)
            torch.testing.assert_close(got, where + 1.7 * want[name].float(), atol=1e-6, rtol=1e-6)
    assert torch.equal(
        module.embed(ids, layouts["panels"].data, NO_SCALES, torch.zeros(d), 2.0),
        module.embed(ids, rows, NO_SCALES, torch.zeros(d), 2.0),
    )
    with pytest.raises(RuntimeError, match="outside the table"):
        module.embed(torch.tensor([64]), layouts["panels"].data, NO_SCALES, torch.zeros(d), 1.0)
    with pytest.raises(RuntimeError, match="scales"):
        module.embed(ids, int8_panels, NO_SCALES, torch.zeros(d), 1.0)


def _saved(folder: Path, tokenizer: Tokenizer, tied: bool) -> Path:
    """A tiny model with an output bias (Marian's final_logits_bias), its 1,000-piece vocabulary
    no multiple of the panels' width, random float32 weights (not exact in float16)."""
    torch.manual_seed(5)
    model = Transformer(tiny_config(tokenizer.vocab_size, share_embeddings=tied, output_bias=True)).eval()
    assert model.output_bias is not None
    with torch.no_grad():
        model.output_bias.normal_(0, 0.5)
    checkpoint.save(folder, model, tokenizer, {"source_lang": "de", "target_lang": "en"})
    return folder


@pytest.mark.parametrize("precision", ["float32", "int8"])
@pytest.mark.parametrize("tied", [True, False])
def test_the_output_projection_runs_on_panels_that_the_lookups_read(
    tmp_path: Path, tiny_tokenizer: Tokenizer, precision: str, tied: bool
) -> None:
    """Loaded for inference with the fused kernels, the output projection runs on their panels
    (the last one padded) with its bias; a tied model's token table is then those panels alone
    (float32: exactly its rows; int8: the rows as CTranslate2 reads an int8 model's embeddings),
    an untied one's output matrix is released. Greedy and beam outputs are those of the same plan
    on the kept float weights (int8: their table set to the rows the lookups read), and the
    teacher-forced logits agree to float rounding (int8: to its quantization)."""
    plan = kernels.choose("cpu", precision, HERE)
    require(plan.fused is not None and fused.load(plan.fused) is not None, "the fused step kernels do not build here")
    if precision == "int8":
        require(kernels.int8_kernels(plan) is not None, "int8 on the fused kernels' panels needs AVX2 or VNNI")
    folder = _saved(tmp_path / "m", tiny_tokenizer, tied)
    ckpt = loading.load(folder, "cpu", precision)
    kept = loading.load(folder, "cpu", "float32", keep_float_weights=True)
    kernels.install(kept.model, ckpt.plan)
    model, vocab = ckpt.model, ckpt.config.tgt_vocab_size
    packed = kernels.PackedPanels if precision == "float32" else kernels.PackedInt8Panels
    assert isinstance(model.kernel, packed) and model.kernel.out_features == vocab
    assert model.kernel.panels.shape[0] * model.kernel.panels.shape[2] > vocab  # (a padded last panel)
    assert model.output_matrix().is_meta
    lookup = model.tgt_embed.lookup
    if tied:
        assert isinstance(lookup, TokenTable) and lookup.data is model.kernel.panels
        assert model.src_embed.lookup is lookup
        if precision == "int8":
            with torch.no_grad():
                kept.model.tgt_embed.tokens.weight.copy_(lookup(torch.arange(vocab)))
        else:
            assert torch.equal(lookup(torch.arange(vocab)), kept.model.output_matrix())
    else:
        assert lookup is None and not model.tgt_embed.tokens.weight.is_meta
    src, tgt = torch.tensor([[5, 6, 7, 3], [9, 3, 0, 0]]), torch.tensor([[2, 8, 9], [2, 4, 0]])
    # (int8: the modules' pass quantizes activations per row here, per tensor in fbgemm's)
    tolerance = 1e-4 if precision == "float32" else 0.3
    with torch.inference_mode():
        torch.testing.assert_close(model(src, tgt), kept.model(src, tgt), atol=tolerance, rtol=tolerance)
    texts = ["ein Hund läuft", "zwei Männer spielen Fußball im Park", "x"]
    ids = ckpt.tokenizer.encode(texts)
    for beam in (1, 3):
        options = DecodingOptions(beam_size=beam, max_length=12)
        ours = Translator(model, ckpt.tokenizer).decode_ids(ids, options)
        reference = Translator(kept.model, kept.tokenizer).decode_ids(ids, options)
        assert [[h.ids for h in hyps] for hyps in ours] == [[h.ids for h in hyps] for hyps in reference]


def test_a_shortlist_takes_the_panels_back_into_rows(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    """A shortlist gathers rows of the output matrix: ``shortlist_output`` unpacks the panels into
    the tied table again, exactly, and the lookups read it."""
    plan = kernels.choose("cpu", "float32", HERE)
    require(plan.fused is not None and fused.load(plan.fused) is not None, "the fused step kernels do not build here")
    torch.manual_seed(6)
    model = Transformer(tiny_config(tiny_tokenizer.vocab_size, share_embeddings=True)).eval()
    checkpoint.save(tmp_path / "m", model, tiny_tokenizer, {"source_lang": "de", "target_lang": "en"})
    ckpt = loading.load(tmp_path / "m")
    assert ckpt.model.output_matrix().is_meta
    assert loading.shortlist_output(ckpt.model) > 0
    assert ckpt.model.kernel is kernels.upcast and ckpt.model.tgt_embed.lookup is None
    assert torch.equal(ckpt.model.output_matrix(), model.output_matrix().detach())
