"""The fused decoder-step kernels (model/engine/fused.py, model/engine/csrc): chosen from
the CPU's features, built here for real, and giving the tensor operations' results."""

from __future__ import annotations

import gzip
import logging
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model.engine import fused, kernels, loading
from model.engine.batches import pad
from model.engine.beams import Beams
from model.engine.decoding import DecodeSession, Hypothesis, decode_stream
from model.engine.encoder import EncoderPass
from model.engine.features import (
    AVX2_ONLY,
    AVX512_BF16,
    AVX512_NO_VNNI,
    BASELINE,
    CpuFeatures,
    detected,
    fused_variant,
    runnable_variants,
)
from model.engine.kernels import fbgemm_ops
from model.engine.kernels.tables import NO_SCALES
from model.engine.options import DecodingOptions
from model.engine.search_ops import FusedSearchOps, SearchOps, TensorSearchOps
from model.engine.shortlist import ShortlistColumns
from model.engine.step import DecoderStep, bound_passes
from model.engine.translator import Translator
from model.network.transformer import Transformer
from tests.factories import V, assert_steps_match, make_model, sources
from tests.helpers import ROOT, require

pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("fused_kernels")]

HERE = detected()
# every variant this CPU can run: its own and the narrower ones
RUNNABLE = runnable_variants(HERE)


def variants(names: list[str]) -> list[object]:
    """``names`` as parameters: this CPU's own variant (the ``fused_kernels`` fixture's build) as
    it is, the others marked ``compile`` (each is another build of the kernels)."""
    return [pytest.param(v, marks=() if v == fused_variant(HERE) else pytest.mark.compile) for v in names]


EVERY = torch.empty(0, dtype=torch.long)  # the kernels' row maps: every row, in order


def built(variant: str) -> str:
    """``variant``, once its kernels load here (skipped without a compiler; a failure in CI)."""
    require(fused.load(variant) is not None, f"the fused step kernels ({variant}) do not build here: see the log")
    return variant


def test_the_variant_follows_the_cpu_features_and_the_isa_caps() -> None:
    assert fused_variant(AVX512_BF16) == "avx512vnni"
    assert fused_variant(AVX512_NO_VNNI) == "avx512"
    assert fused_variant(AVX2_ONLY) == "avx2"
    assert fused_variant(replace(AVX2_ONLY, fma=False)) == "baseline"
    assert fused_variant(BASELINE) == "baseline"
    capped = AVX512_BF16.capped({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert fused_variant(capped) == "avx2"
    assert runnable_variants(AVX512_BF16) == ["avx2", "avx512", "avx512vnni", "baseline"]
    assert runnable_variants(AVX512_NO_VNNI) == ["avx2", "avx512", "baseline"]
    assert runnable_variants(AVX2_ONLY) == ["avx2", "baseline"]
    assert runnable_variants(BASELINE) == ["baseline"]


def test_plans_with_float32_activations_name_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 and int8 (float32 activations) on the CPU; never bfloat16, float16 or CUDA; off
    by argument or by ``TRANSLATOR_FUSED_STEP``."""
    monkeypatch.delenv(fused.ENV, raising=False)
    for precision in ("float32", "int8"):
        plan = kernels.choose("cpu", precision, AVX2_ONLY, engines=["fbgemm"])
        assert plan.fused == "avx2" and "fused step kernels (avx2)" in plan.describe()
        assert kernels.choose("cpu", precision, AVX2_ONLY, engines=["fbgemm"], fused=False).fused is None
    # which int8 products the kernels take, by the CPU's features: every row count on AVX2 and on
    # AVX-512 with VNNI, few on AVX-512 without it
    int8_rows = {
        features: kernels.choose("cpu", "int8", features, engines=["fbgemm"]).describe()
        for features in (AVX2_ONLY, AVX512_BF16, AVX512_NO_VNNI)
    }
    assert "int8 products on the fused kernels (every row count)" in int8_rows[AVX2_ONLY]
    assert (
        "fused step kernels (avx512vnni), int8 products on the fused kernels (every row count)"
        in int8_rows[AVX512_BF16]
    )
    assert (
        "fused step kernels (avx512), int8 products on the fused kernels (up to 16 rows, fbgemm beyond)"
        in int8_rows[AVX512_NO_VNNI]
    )
    assert "int8 products" not in kernels.choose("cpu", "int8", AVX2_ONLY, engines=["fbgemm"], fused=False).describe()
    assert "int8 products" not in kernels.choose("cpu", "float32", AVX2_ONLY).describe()
    assert kernels.int8_products("int8", "avx2") == "fused kernels (every row count)"
    assert kernels.int8_products("int8", "avx512") == "fused kernels (up to 16 rows, fbgemm beyond)"
    assert kernels.int8_products("int8", "avx512vnni") == "fused kernels (every row count)"
    assert kernels.int8_products("int8", None) == kernels.int8_products("int8", "baseline") == "fbgemm"
    assert kernels.int8_products("float32", "avx2") is None
    for precision in ("bfloat16", "float16"):
        assert kernels.choose("cpu", precision, AVX512_BF16).fused is None
    assert kernels.choose("cuda", "float32").fused is None
    for off in ("off", "0", "false"):
        monkeypatch.setenv(fused.ENV, off)
        assert kernels.choose("cpu", "float32", AVX512_BF16).fused is None


@pytest.mark.parametrize("variant", variants(RUNNABLE))
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_fused_steps_match_full_recomputation(variant: str, norm_first: bool, positions: str) -> None:
    """Every variant this CPU runs, post-LN and pre-LN: the fused step on the KV cache (padded
    sources) gives the modules' teacher-forced logits."""
    model = make_model(norm_first=norm_first, positions=positions)
    model.fused_step = built(variant)
    src = pad(sources(4), 0)
    assert (src == 0).any()
    tgt = torch.randint(4, V, (4, 9))
    tgt[:, 0] = 2
    with torch.no_grad():
        full = model(src, tgt)
    with torch.inference_mode():
        assert DecoderStep(model).fused is fused.load(variant)
        assert_steps_match(model, src, tgt, full, tol=1e-5)


@pytest.mark.parametrize("variant", variants(RUNNABLE))
def test_few_row_products_are_torchs_to_float_rounding(variant: str) -> None:
    """The kernels' own matrix product: x wᵀ + bias (or none), ReLU'd or not, at 1-9 rows, for
    weights of whole 16-row blocks and with a remainder (the shortlist's column counts); each
    row's result is the same bits whatever rows come with it."""
    linear = fused.load(built(variant)).linear  # type: ignore[union-attr]
    torch.manual_seed(0)
    for n, k in [(48, 16), (64, 256), (37, 32), (5, 64), (2211, 256)]:
        w, b = torch.randn(n, k) / k**0.5, torch.randn(n)
        for rows in (1, 2, 3, 4, 5, 9):
            x = torch.randn(rows, k)
            for bias in (b, None):
                want = x @ w.t() if bias is None else torch.addmm(bias, x, w.t())
                for relu in (False, True):
                    got = linear(x, w, torch.empty(0) if bias is None else bias, relu)
                    torch.testing.assert_close(got, want.relu() if relu else want, atol=2e-5, rtol=1e-5)
            alone = linear(x[-1:].clone(), w, b, False)
            assert torch.equal(alone[0], linear(x, w, b, False)[-1])
    with pytest.raises(RuntimeError, match="multiple of 16"):
        linear(torch.randn(2, 24), torch.randn(8, 24), torch.empty(0), False)


@pytest.mark.parametrize("variant", variants(RUNNABLE))
def test_panel_products_are_torchs_to_float_rounding(variant: str) -> None:
    """The product on packed panels: x wᵀ + bias (or none), ReLU'd or not, at 1-70 rows (whole
    blocks of rows and every remainder), K of any size; a row's result is the same bits
    whatever values the other rows of its block hold; weights it cannot pack are refused."""
    kernels_module = fused.load(built(variant))
    assert kernels_module is not None
    width = kernels_module.panel_width()
    assert width in (16, 32)
    torch.manual_seed(0)
    for n, k in [(width, 24), (3 * width, 256), (2 * width, 1024)]:
        w, b = torch.randn(n, k) / k**0.5, torch.randn(n)
        panels = kernels_module.pack_panels(w)
        assert panels.shape == (n // width, k, width)
        for rows in (1, 5, 7, 8, 9, 17, 70):
            x = torch.randn(rows, k)
            for bias in (b, None):
                want = x @ w.t() if bias is None else torch.addmm(bias, x, w.t())
                for relu in (False, True):
                    got = kernels_module.panel_linear(x, panels, torch.empty(0) if bias is None else bias, relu)
                    torch.testing.assert_close(got, want.relu() if relu else want, atol=3e-5, rtol=1e-5)
            others = x.clone()
            others[1:] = torch.randn(rows - 1, k)
            got_first = kernels_module.panel_linear(others, panels, b, False)[0]
            assert torch.equal(got_first, kernels_module.panel_linear(x, panels, b, False)[0])
    nan_row = torch.randn(3, 24)
    nan_row[0, 5] = float("nan")
    got = kernels_module.panel_linear(nan_row, kernels_module.pack_panels(torch.randn(width, 24)), torch.empty(0), True)
    assert got[0].isnan().all() and not got[1:].isnan().any()  # ReLU keeps NaN, as torch's
    # a weight of no whole number of panels (a vocabulary): the last panel padded with zeros, and
    # panel_columns gives its rows' columns alone, bias and ReLU included
    odd, odd_bias = torch.randn(2 * width + 3, 40), torch.randn(2 * width + 3)
    padded = kernels_module.pack_panels(odd)
    assert padded.shape == (3, 40, width) and not padded[2, :, 3:].any()
    x = torch.randn(9, 40)
    got = kernels_module.panel_columns(x, padded, odd_bias, True, odd.shape[0])
    torch.testing.assert_close(got, torch.addmm(odd_bias, x, odd.t()).relu(), atol=3e-5, rtol=1e-5)
    assert torch.equal(kernels_module.pack_panels(odd[:3]).transpose(1, 2)[0, :3], odd[:3])
    # a product that keeps only the first columns (a shortlist's, its last panel padded): the
    # same numbers as the whole product's first columns, for every count the panels can hold
    w = torch.randn(3 * width, 64)
    panels, x = kernels_module.pack_panels(w), torch.randn(13, 64)
    whole = kernels_module.panel_linear(x, panels, torch.empty(0), False)
    for columns in (2 * width + 1, 3 * width - 1, 3 * width):
        got = kernels_module.panel_product(x, panels, columns)
        assert got.shape == (13, columns) and got.is_contiguous() and torch.equal(got, whole[:, :columns])
    for columns in (2 * width, 3 * width + 1):  # a whole panel more than needed, or too few panels
        with pytest.raises(RuntimeError, match="columns of 3 panels"):
            kernels_module.panel_product(x, panels, columns)
    with pytest.raises(RuntimeError, match="panels must be"):
        other_k = kernels_module.pack_panels(torch.randn(width, 8))
        kernels_module.panel_linear(torch.randn(2, 16), other_k, torch.empty(0), False)


@pytest.mark.parametrize("variant", variants(RUNNABLE))
def test_results_do_not_depend_on_the_threads_that_share_the_work(variant: str) -> None:
    """The kernels split their work over torch's threads, and each task (a panel, a row and head,
    a row) is computed alone in a fixed order, so the bits do not depend on the split: a pass's
    products, attention, joins and cache reorder on 1 thread and on more threads than this machine
    has cores (which the OS preempts in turn)."""
    kernels_module = fused.load(built(variant))
    assert kernels_module is not None
    torch.manual_seed(1)
    width = kernels_module.panel_width()
    panels, bias = kernels_module.pack_panels(torch.randn(64 * width, 256) / 16), torch.randn(64 * width)
    x, y = torch.randn(256, 256), torch.randn(256, 256)
    norm = (torch.rand(256) + 0.5, torch.randn(256))
    qkv, q = torch.randn(256, 768), torch.randn(256, 256)
    k, v = torch.randn(64, 4, 40, 64), torch.randn(64, 4, 40, 64)
    mask = torch.rand(64, 40) > 0.1
    rows = torch.randperm(256) % 200

    def run() -> list[torch.Tensor]:
        cache_k, cache_v = torch.zeros(256, 4, 24, 64), torch.zeros(256, 4, 24, 64)
        cache_k[:, :, :20] = torch.randn(256, 4, 20, 64, generator=torch.Generator().manual_seed(2))
        cache_v[:, :, :20] = 1.0
        into_k, into_v = torch.empty(256, 4, 24, 64), torch.empty(256, 4, 24, 64)
        kernels_module.gather_rows_(cache_k, cache_v, rows, into_k, into_v, torch.empty(0, dtype=torch.long))
        return [
            kernels_module.panel_linear(x, panels, bias, True),
            kernels_module.add_norm_(x.clone(), y, *norm, 1e-5),
            kernels_module.self_attend(qkv, cache_k, cache_v, 20, torch.empty(0, dtype=torch.bool), 0.125, EVERY),
            kernels_module.cross_attend(q, k, v, mask, 0.125, EVERY),
            into_k,
            into_v,
        ]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run()
        torch.set_num_threads(3 * (os.cpu_count() or 1))
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(alone, run(), strict=True))
    finally:
        torch.set_num_threads(before)


def test_few_row_products_follow_the_variant_and_the_weights() -> None:
    """Which products run on the kernels' ``linear``: up to 4 rows on the AVX-512 and AVX2
    builds, none on the default build (slower than MKL there); only weights it can read as they
    are (float32 with storage, contiguous, K a multiple of 16)."""
    assert [fused.few_rows_limit(v) for v in ("avx512vnni", "avx512", "avx2", "baseline", None)] == [4, 4, 4, 0, 0]
    w = torch.randn(32, 64)
    assert fused.streamable(w, None) and fused.streamable(w, torch.zeros(32))
    assert not fused.streamable(w.half(), None)
    assert not fused.streamable(torch.empty(32, 64, device="meta"), None)  # a released weight's placeholder
    assert not fused.streamable(w.t(), None)
    assert not fused.streamable(torch.randn(32, 24), None)
    assert not fused.streamable(w, torch.zeros(31))
    assert [fused.panel_rows_limit(v) for v in ("avx512vnni", "avx512", "avx2", "baseline", None)] == [
        256,
        256,
        256,
        0,
        0,
    ]
    assert fused.packable(w, None) and fused.packable(w, torch.zeros(32))
    assert fused.packable(torch.randn(32, 24), None)  # any K
    assert fused.packable(torch.randn(48, 64), None)  # any N: the last panel padded
    assert not fused.packable(w.half(), None)
    assert not fused.packable(torch.empty(32, 64, device="meta"), None)
    assert not fused.packable(w.t(), None)
    assert not fused.packable(w, torch.zeros(31))


@pytest.mark.parametrize("variant", variants(RUNNABLE))
def test_small_products_run_on_the_kernels_and_large_ones_on_torch(variant: str) -> None:
    """A bound layer of the decoder step and of the encoder that runs MKL (``aten``) on its kept
    float weight: at most the variant's few-row limit gives the kernels' ``linear`` exactly, up to
    its panel limit the product on the layer's packed panels, more rows the layer's own kernel's;
    a layer on another kernel (``wx`` here: AVX2 CPUs other than Intel's) makes no panels, and
    neither does the output projection."""
    model = make_model()
    model.fused_step = built(variant)
    kernels_module = fused.load(variant)
    assert kernels_module is not None
    for module in model.modules():
        if hasattr(module, "kernel"):
            module.kernel = kernels.aten
    model.decoder_layers[0].ff.fc2.kernel = kernels.wx
    with torch.inference_mode():
        step, encoder = DecoderStep(model), EncoderPass(model)
        wx_layer, x = model.decoder_layers[0].ff.fc2, torch.randn(8, model.config.d_ff)
        assert torch.equal(step.layers[0].fc2(x, False), kernels.wx(x, wx_layer.weight, wx_layer.bias))
        h = torch.randn(8, model.config.d_model)
        assert torch.equal(step.output(h, False), kernels.aten(h, model.output_matrix(), None))
        few, panel = step.few_rows.limit, step.few_rows.panel_limit
        assert (few, panel) == (fused.few_rows_limit(variant), fused.panel_rows_limit(variant))
        for layer, bound in [
            (model.decoder_layers[0].ff.fc1, step.layers[0].fc1),
            (model.encoder_layers[1].self_attn.qkv, encoder.layers[1].qkv),
        ]:
            assert fused.packable(layer.weight, layer.bias)
            panels = kernels_module.pack_panels(layer.weight)
            for rows in sorted({1, few, few + 1, 8, panel, panel + 1} - {0}):
                x = torch.randn(rows, layer.weight.shape[1])
                got = bound(x, True)
                if rows <= few:
                    assert torch.equal(got, kernels_module.linear(x, layer.weight, layer.bias, True))
                elif rows <= panel:
                    assert torch.equal(got, kernels_module.panel_linear(x, panels, layer.bias, True))
                else:
                    assert torch.equal(got, kernels.bind(layer.kernel, layer.weight, layer.bias)(x, True))


def test_int8_layers_run_int8_at_every_row_count() -> None:
    """An int8 model's step layers and output projection run int8 at every row count: on the
    kernels' ``int8_linear`` (fbgemm's quantized weight) up to the variant's ``INT8_ROWS``,
    fbgemm's beyond; the kernels' float ``linear`` never takes a layer whose kernel is not a float
    one, even where the float weight is still there (a tied model's embeddings)."""
    try:
        plan = kernels.choose("cpu", "int8")
    except kernels.UnsupportedPrecision as err:
        pytest.skip(str(err))
    model = make_model()
    kernels.install(model, plan, model.step_linears())
    require(model.fused_step is not None, "the fused step kernels do not build here")
    kernels_module = fused.load(model.fused_step)
    assert kernels_module is not None
    layer = model.decoder_layers[0].ff.fc1
    out = model.output_matrix()
    assert fused.streamable(out, None)  # the float weight is there, and still not used
    with torch.inference_mode():
        step = DecoderStep(model)
        limit = step.few_rows.int8_limit
        assert limit == fused.int8_rows_limit(model.fused_step) > 0
        assert layer.weight.shape[0] % kernels_module.int8_panel_width() == 0
        for bound, kernel, weight, bias, relu in [
            (step.layers[0].fc1, layer.kernel, layer.weight, layer.bias, True),
            (step.output, model.kernel, out, None, False),
        ]:
            found = kernels.int8_weight(kernel, weight, bias)
            assert found is not None
            quantized, scales, b = found
            # (the test vocabulary, 60, is no multiple of the panel width: its last panel padded)
            takes = fused.int8_packable(quantized)
            panels, colsums = kernels_module.pack_int8(quantized) if takes else (None, None)
            scales = F.pad(scales, (0, 0 if colsums is None else colsums.shape[0] - scales.shape[0]))
            fbgemm = kernels.bind(kernel, weight, bias)
            for rows in sorted({1, 4, 9, min(limit + 1, 40)}):
                x = torch.randn(rows, weight.shape[1])
                got = bound(x, relu)
                if rows <= limit and takes:
                    assert torch.equal(
                        got,
                        kernels_module.int8_columns(
                            x, panels, colsums, scales, torch.empty(0) if b is None else b, relu, weight.shape[0]
                        ),
                    )
                else:
                    assert torch.equal(got, fbgemm(x, relu))
                floats = x @ weight.t() + (0 if bias is None else bias)
                floats = floats.relu() if relu else floats
                assert not torch.allclose(got, floats, atol=1e-6, rtol=0)  # quantized, not the float product
                torch.testing.assert_close(got, floats, atol=0.05 * floats.abs().max().item(), rtol=0)
                if rows == 1 and takes:  # one row: fbgemm's quantization of the tensor, to 7 bits, is the row's
                    # (7 bits: fbgemm's reduce_range, which the plan turns off where the CPU has VNNI)
                    seven_bits = kernels.bind(kernels.Int8Kernel(True), weight, bias)
                    torch.testing.assert_close(got, seven_bits(x, relu), atol=1e-5, rtol=1e-5)
    assert not kernels.reads_float_weight(layer.kernel) and kernels.reads_float_weight(kernels.aten)


def _int8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``int8_linear``'s arithmetic written with tensor operations: each row of x (R, K) quantized
    to 7-bit codes with a zero point over [min(0, min), max(0, max)], the product summed exactly
    (int64), scaled back -> (R, N)."""
    lo, hi = x.amin(1, keepdim=True).clamp(max=0), x.amax(1, keepdim=True).clamp(min=0)
    s = (hi - lo) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    z = torch.round(-lo / s).clamp(0, 127)
    codes = (torch.round(x * (1 / s)) + z).clamp(0, 127).to(torch.int64)
    sums = codes @ q.to(torch.int64).t() - z.to(torch.int64) * q.to(torch.int64).sum(1)
    out = s * scales * sums.to(torch.float32)
    return out if bias is None else out + bias


@pytest.mark.parametrize("variant", variants([v for v in RUNNABLE if fused.int8_rows_limit(v) > 0]))
def test_int8_products_quantize_each_row_as_fbgemm_quantizes_a_tensor(variant: str) -> None:
    """The kernels' int8 product: fbgemm's quantized weight (per output channel) by each row's
    activations quantized to 7 bits with a zero point of their own, summed exactly; at one row the
    same as fbgemm's dynamic linear (whose one scale for the tensor is then the row's) to float
    rounding; each row's result the same bits whatever rows come with it; no 16-bit saturation at
    the extremes (every weight ±127, every code 127 or 0)."""
    kernels_module = fused.load(built(variant))
    assert kernels_module is not None
    torch.manual_seed(0)
    for n, k in [(16, 4), (64, 256), (48, 1024), (8000, 32)]:
        w, b = torch.randn(n, k) / k**0.5, torch.randn(n)
        quantized, scales, bias = kernels.int8_weight(kernels.Int8Kernel(True), w, b) or pytest.fail("no weight")
        panels, colsums = kernels_module.pack_int8(quantized)
        assert torch.equal(colsums, quantized.sum(1).to(torch.int32))
        for rows in (1, 2, 3, 4, 5, 9, 70):
            x = torch.randn(rows, k) * 3
            x[0] = x[0].relu()  # a row without negatives: zero point 0
            for relu in (False, True):
                got = kernels_module.int8_linear(x, panels, colsums, scales, bias, relu)
                want = _int8_reference(x, quantized, scales, bias)
                torch.testing.assert_close(got, want.relu() if relu else want, atol=1e-4, rtol=1e-5)
            no_bias = torch.empty(0)
            alone = kernels_module.int8_linear(x[-1:].clone(), panels, colsums, scales, no_bias, False)
            assert torch.equal(alone[0], kernels_module.int8_linear(x, panels, colsums, scales, no_bias, False)[-1])
        one = torch.randn(1, k)
        with kernels.quantized_engine("fbgemm"):
            fbgemm = torch.ops.quantized.linear_dynamic(one, fbgemm_ops._pack_int8(w, b), True)
        torch.testing.assert_close(kernels_module.int8_linear(one, panels, colsums, scales, bias, False), fbgemm,
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
    extreme = torch.full((32, 256), 127, dtype=torch.int8)
    extreme[::2] = -127
    panels, colsums = kernels_module.pack_int8(extreme)
    x = torch.zeros(2, 256)
    x[0] = 1.0  # every code 127 (zero point 0)
    x[1, ::2] = -1.0  # codes 0 and 127 alternating (zero point 64)
    x[1, 1::2] = 1.0
    ones = torch.ones(32)
    got = kernels_module.int8_linear(x, panels, colsums, ones, torch.empty(0), False)
    torch.testing.assert_close(got, _int8_reference(x, extreme, ones, None), atol=0, rtol=1e-6)
    assert got[0, 1].item() == pytest.approx(127 * 256, rel=1e-6)  # s = 1 / 127, codes 127, weights 127
    # N of no whole number of panels (a vocabulary): the last panel padded with zeros, and
    # int8_columns computes the first N outputs alone, as the whole product's
    odd = torch.randint(-127, 128, (21, 32), dtype=torch.int8)
    panels_odd, colsums_odd = kernels_module.pack_int8(odd)
    assert panels_odd.shape == (2, 8, 16, 4) and colsums_odd.shape == (32,) and not colsums_odd[21:].any()
    x_odd, scales_odd, bias_odd = torch.randn(5, 32), torch.rand(32) + 0.5, torch.randn(21)
    got = kernels_module.int8_columns(x_odd, panels_odd, colsums_odd, scales_odd, bias_odd, True, 21)
    whole = kernels_module.int8_linear(x_odd, panels_odd, colsums_odd, scales_odd, F.pad(bias_odd, (0, 11)), True)
    assert got.shape == (5, 21) and torch.equal(got, whole[:, :21])
    with pytest.raises(RuntimeError, match="multiple of 4"):
        kernels_module.pack_int8(torch.zeros(24, 30, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="x's K"):
        kernels_module.int8_linear(torch.randn(2, 64), panels, colsums, ones, torch.empty(0), False)


@pytest.mark.compile
def test_int8_products_give_the_same_bits_in_every_build_that_takes_them() -> None:
    """The AVX-512 VNNI build's int8 product (vpdpbusd, 8 rows a block) and the AVX2 code of the
    other builds (vpmaddubsw, 4 rows a block) sum the same codes exactly: the same bits out, for
    every row count, so an int8 model translates alike on every CPU."""
    variants = [v for v in RUNNABLE if fused.int8_rows_limit(v) > 0]
    if len(variants) < 2:
        pytest.skip(f"one build with int8 products runs here ({', '.join(variants) or 'none'})")
    modules = [fused.load(built(v)) for v in variants]
    torch.manual_seed(1)
    for n, k in [(16, 4), (768, 256), (256, 1024)]:
        w, b = torch.randn(n, k) / k**0.5, torch.randn(n)
        quantized, scales, bias = kernels.int8_weight(kernels.Int8Kernel(True), w, b) or pytest.fail("no weight")
        for rows in (1, 3, 4, 7, 8, 9, 16, 70):
            x = torch.randn(rows, k) * 2
            outs = [m.int8_linear(x, *m.pack_int8(quantized), scales, bias, True) for m in modules if m is not None]
            assert len(outs) == len(variants)
            for variant, out in zip(variants[1:], outs[1:], strict=True):
                assert torch.equal(out, outs[0]), (variant, variants[0], n, k, rows)


@pytest.mark.parametrize("variant", variants(RUNNABLE))
def test_the_encoder_runs_its_attention_and_joins_on_the_kernels(variant: str) -> None:
    """``EncoderPass`` on the kernels (padded sentences, post-LN and pre-LN, sinusoidal and
    learned positions) gives the modules' encoder output; the attention kernel alone gives
    SDPA's with the padding masked; the embedding kernel gives ``Embedding``'s sum, one position
    table row per position of each sentence laid end to end."""
    kernels_module = fused.load(built(variant))
    assert kernels_module is not None
    for norm_first, positions in [(False, "sinusoidal"), (True, "sinusoidal"), (False, "learned")]:
        model = make_model(norm_first=norm_first, positions=positions)
        model.fused_step = variant
        src = pad(sources(5), 0)
        with torch.inference_mode():
            encoder = EncoderPass(model)
            assert encoder.fused is kernels_module
            torch.testing.assert_close(encoder(src)[0], model.encode(src)[0], atol=1e-5, rtol=1e-5)
            embedding = model.src_embed
            table = embedding.learned.weight if embedding.learned is not None else embedding.table
            assert table is not None
            got = kernels_module.embed(
                src.reshape(-1), embedding.tokens.weight, NO_SCALES, table[: src.shape[1]], embedding.scale
            )
            torch.testing.assert_close(got, embedding(src).reshape(got.shape), atol=1e-6, rtol=1e-6)
            with pytest.raises(RuntimeError, match="positions do not match"):
                kernels_module.embed(
                    src.reshape(-1)[:-1], embedding.tokens.weight, NO_SCALES, table[: src.shape[1]], 1.0
                )
    b, s, h, dh = 3, 7, 4, 16
    qkv = torch.randn(b * s, 3 * h * dh)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, 5:] = mask[2, 2:] = False
    q, k, v = qkv.view(b, s, 3, h, dh).permute(2, 0, 3, 1, 4)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    got = kernels_module.encoder_attend(qkv, mask, h, dh**-0.5)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(b * s, h * dh), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="mask"):
        kernels_module.encoder_attend(qkv, mask[:2], h, 1.0)


def test_int8_plans_keep_the_kv_cache_in_float16_where_the_kernels_convert(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 on the AVX2 and AVX-512 builds with F16C: a float16 KV cache; float32 never; nor
    without F16C, on the baseline build, or without the fused kernels (which alone read it)."""
    monkeypatch.delenv(fused.ENV, raising=False)
    for cpu in (AVX2_ONLY, AVX512_BF16):
        plan = kernels.choose("cpu", "int8", cpu, engines=["fbgemm"])
        assert plan.kv_dtype == torch.float16 and "float16 KV cache" in plan.describe()
        assert kernels.choose("cpu", "float32", cpu).kv_dtype is None
        assert kernels.choose("cpu", "int8", replace(cpu, f16c=False), engines=["fbgemm"]).kv_dtype is None
        assert kernels.choose("cpu", "int8", cpu, engines=["fbgemm"], fused=False).kv_dtype is None
    assert kernels.kv_cache_dtype("int8", "baseline", AVX2_ONLY) is None
    assert CpuFeatures.from_flags(["avx2", "fma", "f16c"]).f16c
    assert not CpuFeatures.from_flags(["avx2", "fma"]).f16c


@pytest.mark.compile
def test_the_cache_reorder_copies_what_index_select_does() -> None:
    """``gather_rows_``: rows gathered (repeated, dropped), rows after them zeroed, positions
    sliced on both sides; keys copied before values, so values may land where keys were; with
    ``first``, each row's positions before its entry left as they were."""
    kernels_module = fused.load(built(RUNNABLE[-1]))
    assert kernels_module is not None
    src = torch.randn(2, 5, 4, 9, 8)  # (k/v, R, H, L, Dh)
    rows = torch.tensor([4, 4, 0])
    k, v = src[0][:, :, 1:7], src[1][:, :, 1:7]  # positions 1..6 of 9: strided views
    want_k, want_v = k[rows], v[rows]
    dst = torch.full((5, 4, 6, 8), float("nan"))
    shared = src[0].reshape(-1)[: 5 * 4 * 6 * 8].view(5, 4, 6, 8)  # the values' target is the keys' storage
    everything = torch.empty(0, dtype=torch.long)
    kernels_module.gather_rows_(k, v, rows, dst, shared, everything)
    assert torch.equal(dst[:3], want_k) and not dst[3:].any()
    assert torch.equal(shared[:3], want_v) and not shared[3:].any()
    with pytest.raises(RuntimeError, match="out of range"):
        kernels_module.gather_rows_(k, v, torch.tensor([5]), dst, dst, everything)
    wide = torch.randn(5, 4, 9, 16)  # head_dim 8 of 16: a head's positions are not one block
    narrow_k, narrow_v = wide[:, :, 2:8, :8], wide[:, :, 2:8, 8:]
    out = torch.full((4, 4, 6, 16), float("nan"))
    out_k, out_v = out[..., :8], out[..., 8:]
    kernels_module.gather_rows_(narrow_k, narrow_v, rows, out_k, out_v, everything)
    assert torch.equal(out_k[:3], narrow_k[rows]) and torch.equal(out_v[:3], narrow_v[rows])
    assert not out[3].any()
    for target_k, target_v, source_k, source_v in [(dst, dst.clone(), k, v), (out_k, out_v, narrow_k, narrow_v)]:
        rows_now = target_k.shape[0]
        first = torch.tensor([0, 2, 6, 9, 4][:rows_now])  # 9: past the end (a clamp, nothing copied)
        target_k.fill_(7.0)
        target_v.fill_(7.0)
        kernels_module.gather_rows_(source_k, source_v, rows, target_k, target_v, first)
        for i in range(rows_now):
            lo = min(int(first[i]), 6)
            for target, source in ((target_k, source_k), (target_v, source_v)):
                assert (target[i, :, :lo] == 7.0).all()  # left alone
                want = source[rows[i], :, lo:] if i < 3 else torch.zeros_like(target[i, :, lo:])
                assert torch.equal(target[i, :, lo:], want)
    with pytest.raises(RuntimeError, match="first must be"):
        kernels_module.gather_rows_(k, v, rows, dst, dst.clone(), torch.tensor([0, 1]))


@pytest.mark.parametrize("variant", variants(RUNNABLE))
def test_the_attention_kernels_compute_some_rows_as_they_compute_all(variant: str) -> None:
    """A step that computes only some of the cache's rows (a joiner's copies left out): each row's
    attention is, bit for bit, what the step over every row gives it; the rows left out keep their
    cache untouched; a row outside the cache is refused."""
    kernels_module = fused.load(built(variant))
    assert kernels_module is not None
    torch.manual_seed(4)
    r, h, dh, slots, pos, s = 8, 4, 16, 10, 6, 7  # 4 sentences of 2 rows
    qkv, q = torch.randn(r, 3 * h * dh), torch.randn(r, h * dh)
    k, v = torch.randn(r, h, slots, dh), torch.randn(r, h, slots, dh)
    visible = torch.rand(r, pos + 1) > 0.3
    visible[:, pos] = True
    memory_k, memory_v = torch.randn(4, h, s, dh), torch.randn(4, h, s, dh)
    mask = torch.rand(4, s) > 0.2
    mask[:, 0] = True
    all_k, all_v = k.clone(), v.clone()
    every = kernels_module.self_attend(qkv, all_k, all_v, pos, visible, 0.3, EVERY)
    some = torch.tensor([0, 1, 2, 4, 6, 7])  # sentences 1 and 2 on their first row only
    some_k, some_v = k.clone(), v.clone()
    part = kernels_module.self_attend(qkv[some], some_k, some_v, pos, visible[some], 0.3, some)
    assert torch.equal(part, every[some])
    assert torch.equal(some_k[some], all_k[some]) and torch.equal(some_v[some], all_v[some])
    assert torch.equal(some_k[[3, 5]], k[[3, 5]]) and torch.equal(some_v[[3, 5]], v[[3, 5]])
    cross = kernels_module.cross_attend(q, memory_k, memory_v, mask, 0.3, EVERY)
    sentences = some.div(2, rounding_mode="floor")
    assert torch.equal(kernels_module.cross_attend(q[some], memory_k, memory_v, mask, 0.3, sentences), cross[some])
    with pytest.raises(RuntimeError, match="out of range"):
        kernels_module.self_attend(qkv[:2], k.clone(), v.clone(), pos, visible[:2], 0.3, torch.tensor([0, r]))
    with pytest.raises(RuntimeError, match="out of range"):
        kernels_module.cross_attend(q[:2], memory_k, memory_v, mask, 0.3, torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match="more than once"):  # two threads would write one cache row
        kernels_module.self_attend(qkv[:2], k.clone(), v.clone(), pos, visible[:2], 0.3, torch.tensor([1, 1]))


@pytest.mark.parametrize("variant", variants(RUNNABLE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_reorder_done_by_the_attention_is_the_reorder_then_the_attention(variant: str, dtype: torch.dtype) -> None:
    """``self_attend`` with a reorder (the cache's copy left to the step): bit for bit what
    ``gather_rows_`` into the cache and then ``self_attend`` give, the cache included: rows
    repeated and dropped, joiners' rows zeroed, each row's positions before its ``first`` left as
    they were, every row or some of them computed, float32 or float16 keys and values; a source
    that is the cache itself is refused (the copy would read what it writes)."""
    kernels_module = fused.load(built(variant))
    assert kernels_module is not None
    torch.manual_seed(5)
    h, dh, pos = 4, 16, 6
    old_k, old_v = (torch.randn(5, h, pos + 3, dh).to(dtype) for _ in range(2))  # the previous layout
    src_k, src_v = old_k[:, :, 1 : pos + 1], old_v[:, :, 1 : pos + 1]  # one position forgotten: strided
    index = torch.tensor([4, 4, 0, 2, 2, 1])  # 6 rows kept of 8: rows 6 and 7 are sentences joining
    first = torch.tensor([0, 0, 2, 0, 9, 3, pos, pos])
    r = 8
    qkv = torch.randn(r, 3 * h * dh)
    visible = torch.ones(r, pos + 1, dtype=torch.bool)
    for i, lo in enumerate(first.tolist()):
        visible[i, : min(lo, pos)] = False  # what the mask hides of a late joiner
    for rows in (EVERY, torch.tensor([0, 1, 2, 3, 5, 6])):  # some: rows 4 and 7 only copied
        computed = qkv if rows.numel() == 0 else qkv[rows]
        seen = visible if rows.numel() == 0 else visible[rows]
        k, v = torch.full((r, h, pos + 1, dh), 7.0, dtype=dtype), torch.full((r, h, pos + 1, dh), 7.0, dtype=dtype)
        want_k, want_v = k.clone(), v.clone()
        kernels_module.gather_rows_(src_k, src_v, index, want_k[:, :, :pos], want_v[:, :, :pos], first)
        want = kernels_module.self_attend(computed, want_k, want_v, pos, seen, 0.25, rows)
        got = kernels_module.self_attend(computed, k, v, pos, seen, 0.25, rows, [src_k, src_v, index, first])
        assert torch.equal(got, want)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        # row 4's first is past the end and the joiners' is this step: none of theirs is copied
        assert (k[4, :, :pos] == 7.0).all() and (k[6:, :, :pos] == 7.0).all()
        assert torch.equal(k[3, :, :pos], src_k[2]) and (k[2, :, :2] == 7.0).all()
    every = torch.empty(0, dtype=torch.long)  # every position of every row: joiners' zeroed
    k, v = torch.full((r, h, pos + 1, dh), 7.0, dtype=dtype), torch.full((r, h, pos + 1, dh), 7.0, dtype=dtype)
    kernels_module.self_attend(qkv, k, v, pos, visible, 0.25, EVERY, [src_k, src_v, index, every])
    assert torch.equal(k[:6, :, :pos], src_k[index]) and torch.equal(v[:6, :, :pos], src_v[index])
    assert not k[6:, :, :pos].any() and not v[6:, :, :pos].any()
    with pytest.raises(RuntimeError, match="the cache itself"):
        kernels_module.self_attend(qkv, k, v, pos, visible, 0.25, EVERY, [k, v, index, every])
    with pytest.raises(RuntimeError, match="out of range"):
        kernels_module.self_attend(qkv, k, v, pos, visible, 0.25, EVERY, [src_k, src_v, torch.tensor([5]), every])


@pytest.mark.parametrize("variant", variants(RUNNABLE))
def test_the_beams_advance_over_some_rows_as_over_all(variant: str) -> None:
    """The beams' advance given only the rows a step computed (a joining sentence's first row; its
    copies at -inf marked -1) chooses exactly what it chooses given every row's logits, shared
    columns and each sentence's own alike; a row with a score and no logits is refused."""
    kernels_module = fused.load(built(variant))
    assert kernels_module is not None
    torch.manual_seed(5)
    a, k, c, e, t, now = 3, 4, 50, 6, 6, 2
    inf = float("inf")
    scores = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [0.0, -inf, -inf, -inf], [-0.5, -1.5, -2.5, -6.0]])
    lengths = torch.tensor([[2] * k, [0] * k, [2] * k])
    finished, eos = torch.zeros(a, k, dtype=torch.bool), torch.zeros(a, k, dtype=torch.bool)
    start = torch.tensor([0, now, 0])  # sentence 1 joined since the last step
    logits, own = torch.randn(a, k, c), torch.randn(a, k, e) + 2  # (its own columns rank high)
    logits[1, 1:], own[1, 1:] = logits[1, 0], own[1, 0]  # its copies compute what its first row does
    vocab, extra, spans = torch.arange(100, 150), torch.arange(200, 220), torch.tensor([[0, 6], [6, 0], [10, 3]])

    def advance(scored: torch.Tensor, mine: torch.Tensor, rows: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
        history = torch.zeros(a, k, t, dtype=torch.long)
        state = (scores, lengths, finished, eos, history)
        return kernels_module.advance(scored, mine, vocab, extra, spans, start, now, *state, 0.6, 3, 0, rows)  # type: ignore[no-any-return]

    computed = [0, 1, 2, 3, 4, 8, 9, 10, 11]
    rows = torch.tensor([0, 1, 2, 3, 4, -1, -1, -1, 5, 6, 7, 8])
    every = advance(logits, own, EVERY)
    some = advance(logits.view(a * k, c)[computed], own.view(a * k, e)[computed], rows)
    assert every[1] == some[1] and all(torch.equal(x, y) for x, y in zip(every[0], some[0], strict=True))
    shared = set(range(100, 150))  # each sentence's tokens: the shared ones and its own (sentence 1 has none)
    for tokens, mine in zip(every[0][1].tolist(), (range(200, 206), range(0), range(210, 213)), strict=True):
        assert set(tokens) <= shared | set(mine)
    assert set(every[0][1][0].tolist()) & set(range(200, 206))  # (its own rank high: chosen)
    alive = rows.clone()
    alive[1] = -1  # sentence 0's second row has a score
    with pytest.raises(RuntimeError, match="has a score but no logits"):
        advance(logits.view(a * k, c)[computed], own.view(a * k, e)[computed], alive)
    with pytest.raises(RuntimeError, match="own columns are not within"):
        history = torch.zeros(a, k, t, dtype=torch.long)
        wide = torch.tensor([[0, 7], [0, 0], [0, 0]])  # 7 own columns of 6
        kernels_module.advance(logits, own, vocab, extra, wide, start, now, scores, lengths, finished, eos, history,
                               0.6, 3, 0, EVERY)  # fmt: skip


@pytest.mark.parametrize("variant", variants(RUNNABLE))
@pytest.mark.parametrize("beam_size", [1, 3])
def test_the_beams_advance_over_own_columns_as_the_tensor_operations_do(variant: str, beam_size: int) -> None:
    """The beams' advance (``SearchOps.advance``) over a shortlist's shared and own columns on the
    kernels and on the tensor operations: the same tokens, back-pointers and scores, step after
    step (EOS among them at beam 3); a sentence's column past its own count is never chosen,
    however high its logit."""
    kernels_module = fused.load(built(variant))
    assert kernels_module is not None
    torch.manual_seed(beam_size)
    a, n, width, steps = 4, 9, 5, 4
    extra_ids = torch.arange(30, 30 + 3 * width)
    spans = torch.tensor([[0, 5], [5, 2], [7, 0], [10, 4]])
    columns = ShortlistColumns(torch.arange(n), torch.empty(0), lambda _: torch.empty(0), extra_ids, torch.empty(0),
                               spans, width)  # fmt: skip
    ops: dict[str, SearchOps] = {"fused": FusedSearchOps(kernels_module), "torch": TensorSearchOps()}
    beams = {name: Beams(beam_size, 0, torch.device("cpu")) for name in ops}
    for b in beams.values():
        b.extend(a, steps)
    start = torch.zeros(a, dtype=torch.long)
    for step in range(steps):
        w = 1 if step == 0 else beam_size
        logits, own = torch.randn(a, w, n), torch.randn(a, w, width) * 3
        own[:, :, 4] = 50.0  # a column past every count but the last sentence's: chosen only there
        if beam_size > 1:
            logits[0, :, 3] += 2 * step  # EOS (3) for sentence 0 as the steps go
        else:  # (a greedy sentence leaves the step it ends: its advance never sees a finished row)
            logits[:, :, 3] = -1e9
        got = {}
        for name, b in beams.items():
            back, tok = ops[name].advance(b, logits.clone(), start, step, 0.6, 3, columns, own.clone())
            got[name] = (back, tok, b.scores.clone(), b.finished.clone())
        fused_back, fused_tok, fused_scores, fused_finished = got["fused"]
        back, tok, scores, finished = got["torch"]
        assert torch.equal(fused_tok, tok) and torch.equal(fused_finished, finished)
        assert (fused_back is None) == (back is None) and (back is None or torch.equal(fused_back, back))
        torch.testing.assert_close(fused_scores, scores)
        allowed = [set(range(n)) | set(extra_ids[f : f + c].tolist()) | {0} for f, c in spans.tolist()]
        assert all(set(row) <= own for row, own in zip(tok.tolist(), allowed, strict=True))


@pytest.mark.parametrize("variant", variants(RUNNABLE))
def test_attention_over_a_float16_cache_is_attention_over_its_float32_values(variant: str) -> None:
    """A float16 KV cache (int8 plans: ``KernelPlan.kv_dtype``): ``self_attend`` stores the new
    key and value rounded as torch rounds (tails past the 8-lane conversions included), and both
    attention kernels give, bit for bit, what they give over the cache widened to float32; the
    reorder copies float16 rows as it copies float32 ones."""
    kernels_module = fused.load(built(variant))
    assert kernels_module is not None
    torch.manual_seed(3)
    r, h, dh, slots, pos = 6, 4, 12, 9, 5  # head_dim 12: one 8-lane conversion and a tail of 4
    qkv = torch.randn(r, 3 * h * dh) * 4
    k16 = (torch.randn(r, h, slots, dh) * 4).half()
    v16 = (torch.randn(r, h, slots, dh) * 4).half()
    visible = torch.rand(r, pos + 1) > 0.3
    visible[:, pos] = True
    k32, v32 = k16.float(), v16.float()
    out16 = kernels_module.self_attend(qkv, k16, v16, pos, visible, 0.3, EVERY)
    new_k, new_v = qkv[:, h * dh : 2 * h * dh].view(r, h, dh), qkv[:, 2 * h * dh :].view(r, h, dh)
    assert torch.equal(k16[:, :, pos], new_k.half()) and torch.equal(v16[:, :, pos], new_v.half())
    rounded = torch.cat([qkv[:, : h * dh], new_k.half().float().view(r, -1), new_v.half().float().view(r, -1)], 1)
    out32 = kernels_module.self_attend(rounded, k32, v32, pos, visible, 0.3, EVERY)
    assert torch.equal(out16, out32) and torch.equal(k32, k16.float())
    q = torch.randn(r, h * dh)
    mask = torch.rand(3, slots) > 0.2
    mask[:, 0] = True
    cross16 = kernels_module.cross_attend(q, k16[:3], v16[:3], mask, 0.3, EVERY)  # 3 sentences, 2 rows each
    assert torch.equal(cross16, kernels_module.cross_attend(q, k32[:3], v32[:3], mask, 0.3, EVERY))
    rows = torch.tensor([5, 0, 0])
    into_k, into_v = torch.full((4, h, slots, dh), float("nan")).half(), torch.empty(4, h, slots, dh).half()
    kernels_module.gather_rows_(k16, v16, rows, into_k, into_v, torch.empty(0, dtype=torch.long))
    assert torch.equal(into_k[:3], k16[rows]) and torch.equal(into_v[:3], v16[rows]) and not into_k[3].any()
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels_module.cross_attend(q, k16[:3], v32[:3], mask, 0.3, EVERY)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernels_module.gather_rows_(k16, v16, rows, into_k.float(), into_v.float(), torch.empty(0, dtype=torch.long))


@pytest.mark.compile
def test_joining_sentences_memory_is_the_tensor_operations_one() -> None:
    """``split_kv`` (joiners' cross-attention K/V, heads apart) gives what the tensor operations give."""
    kernels_module = fused.load(built(RUNNABLE[-1]))
    assert kernels_module is not None
    kv = torch.randn(3 * 5, 2 * 4 * 8)  # 3 sentences of 5 positions, 4 heads of 8
    both = kv.view(3, 5, 2, 4, 8).permute(2, 0, 3, 1, 4)
    k, v = kernels_module.split_kv(kv, 3, 4, False)
    assert k.is_contiguous() and torch.equal(k, both[0]) and torch.equal(v, both[1])
    k16, v16 = kernels_module.split_kv(kv, 3, 4, True)  # the float16 cache's: torch's rounding
    assert k16.dtype == torch.float16 and torch.equal(k16, both[0].half()) and torch.equal(v16, both[1].half())


@pytest.mark.parametrize("variant", variants(RUNNABLE))
def test_each_rows_own_logits_are_its_products_with_its_sentences_rows(variant: str) -> None:
    """``span_logits``: row r's logits over its sentence's own rows (spans of a buffer laid end to
    end), -inf past their count; the same bits alone as beside other sentences, for some rows (a
    row map) as for all, and from float16 rows as from their float32 values; malformed spans and
    rows out of sentence order are refused."""
    kernels_module = fused.load(built(variant))
    assert kernels_module is not None
    torch.manual_seed(2)
    rows, x = torch.randn(60, 32), torch.randn(12, 32)  # 3 sentences of 4 rows
    spans, width = torch.tensor([[0, 5], [10, 0], [20, 17]]), 20
    got = kernels_module.span_logits(x, EVERY, rows, spans, width)
    assert got.shape == (12, width)
    for i, (first, count) in enumerate(spans.tolist()):
        mine = got[4 * i : 4 * i + 4]
        torch.testing.assert_close(
            mine[:, :count], x[4 * i : 4 * i + 4] @ rows[first : first + count].t(), atol=2e-5, rtol=1e-5
        )
        assert bool((mine[:, count:] == -float("inf")).all())
    alone = kernels_module.span_logits(x[8:], EVERY, rows, spans[2:], 17)
    assert torch.equal(alone, got[8:, :17])
    some = [0, 1, 4, 8, 9, 10]  # a row map: sentence 0's first two rows, 1's first, 2's first three
    mapped = kernels_module.span_logits(x[some], torch.tensor([0, 0, 1, 2, 2, 2]), rows, spans, width)
    assert torch.equal(mapped, got[some])
    half = rows.half()
    assert torch.equal(kernels_module.span_logits(x, EVERY, half, spans, width),
                       kernels_module.span_logits(x, EVERY, half.float(), spans, width))  # fmt: skip
    with pytest.raises(RuntimeError, match="not within the rows or the width"):
        kernels_module.span_logits(x, EVERY, rows, torch.tensor([[0, 5], [10, 0], [50, 17]]), width)
    with pytest.raises(RuntimeError, match="not within the rows or the width"):
        kernels_module.span_logits(x, EVERY, rows, spans, 16)
    with pytest.raises(RuntimeError, match="never decreasing"):
        kernels_module.span_logits(x[:3], torch.tensor([1, 0, 2]), rows, spans, width)


@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_the_shipped_model_translates_the_same_on_both_paths(shipped: Path, data_dir: Path, precision: str) -> None:
    """The shipped de-en model, 48 test sentences in batches of 16 (beam 4 and greedy): the same
    translations with the fused kernels as with the tensor operations, scores within rounding
    (int8: within its per-call activation scales)."""
    variant = built(fused_variant(HERE))
    ckpt = loading.load(shipped, "cpu", precision)
    assert ckpt.plan.fused == variant and ckpt.model.fused_step == variant
    # int8: the fused path's KV cache is float16 where the CPU converts with F16C, float32 on the tensor operations'
    half = precision == "int8" and HERE.f16c and variant != "baseline"
    assert ckpt.model.kv_dtype == (torch.float16 if half else None)
    with torch.inference_mode():  # the memory's K/V, which the self-attention cache takes its dtype from
        (k, v), *_ = bound_passes(ckpt.model)[1].project_memory(torch.randn(2, 5, ckpt.model.config.d_model))
    assert k.dtype == v.dtype == (torch.float16 if half else torch.float32)
    translator = Translator(ckpt.model, ckpt.tokenizer, (), loading.use_shortlist(ckpt))
    with gzip.open(data_dir / "test_2016_flickr.de.gz", "rt") as f:
        ids = translator.encode([next(f).strip() for _ in range(48)])
    for beam in (4, 1):
        options = DecodingOptions(beam_size=beam)
        results = {}
        for step_kernels in (variant, None):
            ckpt.model.fused_step = step_kernels
            hypotheses = [h for i in range(0, 48, 16) for h in translator.decode_ids(ids[i : i + 16], options)]
            results[step_kernels] = hypotheses
        pairs = [(a[0], b[0]) for a, b in zip(results[variant], results[None], strict=True)]
        if precision == "float32":
            assert all(a.ids == b.ids and a.score == pytest.approx(b.score, abs=1e-4) for a, b in pairs)
        else:  # activations quantized per call: a rounding apart moves a scale, so scores move more
            same = [a for a, b in pairs if a.ids == b.ids]
            # (the encoder runs on the kernels too: capped to AVX2, 7-bit activations, 44 of 48 on
            # 2026-11-27; 46 or more uncapped)
            assert len(same) >= 42
            # a score sums one log-probability a token, each moved by its step's scales: within
            # 0.015 a token (EOS counted); the spread seen per CPU is in docs/benchmarks/log/2026-11-28.md
            per_token = [abs(a.score - b.score) / (len(a.ids) + 1) for a, b in pairs if a.ids == b.ids]
            assert max(per_token) <= 0.015, per_token


def decode_joining(
    model: Transformer, options: DecodingOptions, first: torch.Tensor, later: torch.Tensor
) -> dict[int, Hypothesis]:
    """``first`` (B, S) padded sources decoded in one session, ``later`` admitted after its first
    step -> each sentence's best hypothesis by tag (``first``'s 0..B-1, then ``later``'s)."""
    session = DecodeSession(model, options)
    session.admit(first, list(range(len(first))))
    done = {d.tag: d.hypotheses[0] for d in session.step()}
    session.admit(later, list(range(len(first), len(first) + len(later))))
    while session.active:
        done.update({d.tag: d.hypotheses[0] for d in session.step()})
    return done


def test_sentences_joining_a_fused_batch_decode_as_if_alone() -> None:
    """Continuous batching on the fused kernels: sentences admitted while others decode get
    what they get decoded alone."""
    model = make_model(seed=5)
    model.fused_step = built(fused_variant(HERE))
    options = DecodingOptions(beam_size=3, max_length_b=6)
    first, later = pad(sources(3, seed=11), 0), pad(sources(2, seed=12), 0)
    alone = {}
    for tag, src in [(0, first[:1]), (1, first[1:2]), (2, first[2:3]), (3, later[:1]), (4, later[1:2])]:
        (done,) = list(decode_stream(model, src[:, : int((src != 0).sum())], options))
        alone[tag] = done.hypotheses[0]
    with torch.inference_mode():
        together = decode_joining(model, options, first, later)
    for tag, hyp in alone.items():
        assert together[tag].ids == hyp.ids
        assert together[tag].score == pytest.approx(hyp.score, abs=1e-4)


def test_a_sentence_joining_a_beam_batch_decodes_one_row_at_its_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sentence that joins a running beam batch has K rows, all copies of its first (at -inf
    but one); its first step computes the first only, and from then on all K. (What it decodes is
    what it decodes alone: the test above.)"""
    model = make_model(seed=5)
    model.fused_step = built(fused_variant(HERE))
    options = DecodingOptions(beam_size=3, max_length_b=6)
    first, later = pad(sources(3, seed=11), 0), pad(sources(2, seed=12), 0)
    computed: list[int] = []
    original = DecoderStep.__call__

    def counting(self: DecoderStep, tokens: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        computed.append(tokens.numel())
        return original(self, tokens, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DecoderStep, "__call__", counting)
    with torch.inference_mode():
        session = DecodeSession(model, options)
        session.admit(first, [0, 1, 2])
        session.step()  # the batch's first step: one row a sentence
        running = session.active
        session.admit(later, [3, 4])
        session.step()
        after = session.active
        session.step()
    assert running == 3 and after == 5
    assert computed == [3, running * 3 + 2, after * 3]


@pytest.mark.parametrize("variant", variants([v for v in RUNNABLE if fused.panel_rows_limit(v) > 0]))
def test_passes_on_panels_alone_run_every_layer_in_one_call(variant: str) -> None:
    """Where every product of a post-LN model runs on packed panels alone (float weights released,
    as ``loading.load`` does on Intel CPUs), the encoder and the decoder step run all their
    layers in one call of the kernels (``encoder_layers``, ``decoder_layers``): the same kernels
    in the same order, so the same numbers, bit for bit, as layer by layer, greedy and beam
    search, sentences joining a running batch included; the encoder's tokens there without
    their padding (``encoder_layers_ragged``), so its memory is the padded layers' at float
    rounding and zero at padded positions. A pre-LN model and layers that kept their float
    weights go layer by layer; a wrong parameter count is refused."""
    kernels_module = fused.load(built(variant))
    assert kernels_module is not None
    src, later = pad(sources(3, seed=21), 0), pad(sources(2, seed=22), 0)

    def decode(model: Transformer, options: DecodingOptions, stacked: bool) -> dict[int, tuple[list[int], float]]:
        encoder, step = bound_passes(model)
        stacks = encoder.stack, step.stack
        if not stacked:
            encoder.stack = step.stack = None
        try:
            done = decode_joining(model, options, src, later)
            memory = encoder(src)[0]
        finally:
            encoder.stack, step.stack = stacks
        hypotheses = {tag: (h.ids, h.score) for tag, h in done.items()}
        return hypotheses, memory

    def same(
        stacked: tuple[dict[int, tuple[list[int], float]], torch.Tensor],
        layered: tuple[dict[int, tuple[list[int], float]], torch.Tensor],
    ) -> None:
        real = (src != 0)[..., None].expand_as(stacked[1])
        torch.testing.assert_close(stacked[1][real], layered[1][real], atol=1e-5, rtol=1e-5)
        assert not stacked[1][~real].any()  # padded positions: zeros
        assert stacked[0].keys() == layered[0].keys()
        for tag, (ids, score) in stacked[0].items():
            assert ids == layered[0][tag][0] and score == pytest.approx(layered[0][tag][1], abs=1e-4)

    plan = replace(kernels.choose("cpu", "float32", HERE), kernel="aten", step_kernel=None, fused=variant)
    for norm_first in (False, True):
        model, kept = (kernels.install(make_model(seed=9, norm_first=norm_first), plan) for _ in range(2))
        assert isinstance(model, Transformer) and isinstance(kept, Transformer)
        kernels.release_float_weights(model, keep=[model.output_matrix()], panels=kernels_module)
        with torch.inference_mode():
            encoder, step = bound_passes(model)
            assert (encoder.stack is None, step.stack is None) == (norm_first, norm_first)
            assert bound_passes(kept)[0].stack is None and bound_passes(kept)[1].stack is None
            for beam in (1, 3):
                options = DecodingOptions(beam_size=beam, max_length_b=6)
                stacked = decode(model, options, True)
                if norm_first:  # (no stack: the same path twice)
                    assert stacked[0] == decode(model, options, False)[0]
                else:
                    same(stacked, decode(model, options, False))
                for tag, (ids, score) in decode(kept, options, True)[0].items():
                    assert ids == stacked[0][tag][0] and score == pytest.approx(stacked[0][tag][1], abs=1e-4)
    x, mask = torch.zeros(1, 32), torch.empty(0, dtype=torch.bool)
    with pytest.raises(TypeError):  # a layer's weights are named, every one of them
        kernels_module.EncoderLayerWeights(qkv=(x, x), out=(x, x), fc1=(x, x), fc2=(x, x), attn_norm=(x, x))
    names = ("self_qkv", "self_out", "cross_q", "cross_out", "fc1", "fc2", "self_norm", "cross_norm", "ff_norm")
    layer = kernels_module.DecoderLayerWeights(**{name: (x, x) for name in names})
    with pytest.raises(RuntimeError, match="one cache of each kind per layer"):
        kernels_module.decoder_layers(x, [layer], [x], [x], [0], mask, [], [x], x, 1.0, 1e-5, EVERY, EVERY, [])


@pytest.mark.parametrize("variant", variants([v for v in RUNNABLE if fused.panel_rows_limit(v) > 0]))
def test_the_encoder_on_panels_alone_computes_no_padding(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the encoder runs in one call of the kernels, the sentences' tokens go through it end
    to end without their padding (``encoder_layers_ragged``): its memory is the padded layers'
    at float rounding, zero at padded positions, and a sentence's memory does not depend on how
    much padding its batch gave it (bit for bit); groups of at most ``ENCODER_CHUNK_TOKENS``
    tokens, whole sentences, give the one-pass memory. The attention kernel alone gives the
    padded kernel's numbers exactly, and refuses offsets that do not cover its rows."""
    from model.engine import encoder as step_module

    kernels_module = fused.load(built(variant))
    assert kernels_module is not None
    plan = replace(kernels.choose("cpu", "float32", HERE), kernel="aten", step_kernel=None, fused=variant)
    model = kernels.install(make_model(seed=9), plan)
    assert isinstance(model, Transformer)
    kernels.release_float_weights(model, keep=[model.output_matrix()], panels=kernels_module)
    rows = sources(6, seed=23, min_len=2, max_len=20)
    src = pad(rows, 0)
    with torch.inference_mode():
        encoder = bound_passes(model)[0]
        assert encoder.stack is not None
        memory, mask = encoder(src)
        real = mask[:, 0, 0, :, None].expand_as(memory)
        stack, encoder.stack = encoder.stack, None
        padded = encoder(src)[0]  # layer by layer, padding included
        encoder.stack = stack
        torch.testing.assert_close(memory[real], padded[real], atol=1e-5, rtol=1e-5)
        assert not memory[~real].any()
        wider = encoder(torch.cat([src, torch.zeros(6, 9, dtype=src.dtype)], dim=1))[0]
        assert torch.equal(wider[:, : src.shape[1]], memory) and not wider[:, src.shape[1] :].any()
        monkeypatch.setattr(step_module, "ENCODER_CHUNK_TOKENS", 25)  # groups of whole sentences
        torch.testing.assert_close(encoder(src)[0], memory, atol=1e-5, rtol=1e-5)
    h, dh = 4, 16
    b, s = src.shape
    qkv = torch.randn(b * s, 3 * h * dh)
    flat = (src != 0).reshape(-1)
    offsets = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()])
    want = kernels_module.encoder_attend(qkv, src != 0, h, dh**-0.5)[flat]
    assert torch.equal(kernels_module.encoder_attend_ragged(qkv[flat], offsets, h, dh**-0.5), want)
    with pytest.raises(RuntimeError, match="offsets must run"):
        kernels_module.encoder_attend_ragged(qkv[flat], offsets[:-1], h, 1.0)
    with pytest.raises(RuntimeError, match="must not decrease"):
        kernels_module.encoder_attend_ragged(qkv[flat], torch.tensor([0, 40, 2, int(flat.sum())]), h, 1.0)


@pytest.mark.slow
def test_the_long_kernels_let_other_python_threads_run() -> None:
    """``panel_linear``, ``int8_linear`` and ``encoder_layers`` (and ``decoder_layers``, declared alike) let go of
    Python's lock while they compute: a Python thread beside them keeps running (the server's
    event loop, while a batch decodes), where it would stand still for the whole call. The
    switch interval is raised so that only a released lock lets it run."""
    module = fused.load(built(fused_variant(HERE)))
    assert module is not None
    torch.manual_seed(0)
    d, f, rows = 256, 1024, 2048

    def packed(n: int, k: int) -> list[torch.Tensor]:
        return [module.pack_panels(torch.randn(n, k) / k**0.5), torch.zeros(n)]

    layer = [*packed(3 * d, d), *packed(d, d), *packed(f, d), *packed(d, f)]
    norm = (torch.ones(d), torch.zeros(d))
    weights = module.EncoderLayerWeights(qkv=tuple(layer[0:2]), out=tuple(layer[2:4]), fc1=tuple(layer[4:6]),
                                         fc2=tuple(layer[6:8]), attn_norm=norm, ff_norm=norm)  # fmt: skip
    x, mask = torch.randn(rows, d), torch.ones(rows // 32, 32, dtype=torch.bool)
    int8_panels, colsums = module.pack_int8(torch.randint(-127, 128, (f, d), dtype=torch.int8))
    calls = {
        "panel_linear": lambda: module.panel_linear(x, layer[4], layer[5], True),
        "int8_linear": lambda: module.int8_linear(x, int8_panels, colsums, torch.ones(f), torch.empty(0), True),
        "encoder_layers": lambda: module.encoder_layers(x.clone(), [weights] * 2, mask, 4, 0.125, 1e-5),
    }
    ticks, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks[0] += 1

    interval = sys.getswitchinterval()
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.02)
        # from here the spinner runs only while the lock is released: the calls below take well under
        # the interval (and each one the spinner runs in costs an interval, while it gives the lock back)
        sys.setswitchinterval(2.0)
        for name, call in calls.items():
            before, until = ticks[0], time.perf_counter() + 0.5
            # calls for up to 0.5 s: on two cores both busy with the kernel's threads, the OS may not
            # run the spinner within one short call (the fastest CPUs finish panel_linear in ~2 ms); a
            # kernel that held the lock would leave it standing through all of them
            while True:
                call()
                if ticks[0] - before > 100 or time.perf_counter() > until:
                    break
            assert ticks[0] - before > 100, f"{name} held Python's lock"
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        spinner.join()


@pytest.mark.compile
def test_kernels_that_cannot_build_leave_the_tensor_operations(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A variant the compiler refuses: ``load`` logs why and returns None (once), and the step
    runs on tensor operations with the same results."""
    monkeypatch.setitem(fused.FLAGS, "broken", ["-fno-such-option-anywhere"])
    with caplog.at_level(logging.WARNING, logger="model.engine.fused"):
        assert fused.load("broken") is None
        assert fused.load("broken") is None
    assert sum("fused decoder-step kernels (broken) unavailable" in r.message for r in caplog.records) == 1
    monkeypatch.delitem(fused._loaded, "broken")
    model = make_model()
    reference = list(decode_stream(model, pad(sources(2), 0), DecodingOptions(beam_size=2)))
    model.fused_step = "broken"
    monkeypatch.setitem(fused._loaded, "broken", None)
    with torch.inference_mode():
        assert DecoderStep(model).fused is None
    again = list(decode_stream(model, pad(sources(2), 0), DecodingOptions(beam_size=2)))
    assert [d.hypotheses for d in again] == [d.hypotheses for d in reference]


def test_shortlist_candidates_are_the_tensor_operations_ones(shipped: Path) -> None:
    """The shipped shortlist: the kernels' candidates of padded random sources (pieces repeated
    across and within sentences) are exactly those of the tensor operations."""
    kernels_here = fused.load(built(fused_variant(HERE)))
    shortlist = loading.use_shortlist(loading.load(shipped, "cpu", "float32"))
    assert shortlist is not None
    torch.manual_seed(0)
    sources = torch.randint(4, shortlist.vocab_size, (5, 12))
    sources[1, 3:] = sources[1, :3].repeat(3)  # repeats within a sentence
    sources[2] = sources[0]  # and across sentences
    real = torch.ones_like(sources, dtype=torch.bool)
    real[3, 7:] = False  # padding
    real[4, 1:] = False
    assert kernels_here is not None
    fast = FusedSearchOps(kernels_here).candidates(shortlist, sources, real)
    plain = TensorSearchOps().candidates(shortlist, sources, real)
    assert len(fast) == len(plain) == 5
    for a, b in zip(fast, plain, strict=True):
        assert torch.equal(a, b)


_LOAD_WITHOUT_COMPILER = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from model.engine import fused
print("buildable", fused.buildable(sys.argv[1]))
print("module", fused.load(sys.argv[1]).__file__)
"""


def test_a_build_in_the_cache_loads_without_a_compiler_or_ninja() -> None:
    """What the Docker image relies on (its runtime has no compiler): a process finds the
    kernels already built in the extension cache and imports them as they are, with no C++
    compiler (``CXX`` pointing nowhere) and no ninja on PATH."""
    import os
    import subprocess

    variant = built(fused_variant(HERE))  # (in this process's cache: the child reads the same)
    env = {**os.environ, "CXX": "/nonexistent/c++", "PATH": "/nonexistent", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_COMPILER, variant], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert "buildable True" in lines, run.stdout
    module = next(line.split(" ", 1)[1] for line in lines if line.startswith("module "))
    assert module == str(fused._prebuilt(variant)) and f"({variant}) loaded from" in run.stdout


@pytest.mark.compile
def test_ahead_of_time_builds_report_what_did_not_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m model.engine.fused --build``: a variant the compiler refuses fails the command (the
    Docker build stops there), naming it; one that builds (or is built already) passes."""
    monkeypatch.setitem(fused.FLAGS, "broken", ["-fno-such-option-anywhere"])
    monkeypatch.setattr(fused, "_loaded", {})
    with pytest.raises(SystemExit, match="did not build: broken"):
        fused.main(["--build", "broken"])
    fused.main(["--build", built(fused_variant(HERE))])


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """torch's builder waits for its lock file forever: one older than any build is removed
    (with a warning), a fresh one (a build under way) is left alone."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    fused._clear_stale_lock(lock)
    assert lock.exists()
    old = time.time() - fused.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="model.engine.fused"):
        fused._clear_stale_lock(lock)
    assert not lock.exists() and "did not finish" in caplog.text
    fused._clear_stale_lock(lock)  # no lock: nothing to do


def test_an_install_without_the_source_leaves_the_tensor_operations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A package installed without model/csrc (say, by a packager that drops data files): a
    warning, no kernels, no crash."""
    monkeypatch.setattr(fused, "CSRC", tmp_path / "missing")
    monkeypatch.setitem(fused.FLAGS, "sourceless", [])
    with caplog.at_level(logging.WARNING, logger="model.engine.fused"):
        assert fused.load("sourceless") is None
    monkeypatch.delitem(fused._loaded, "sourceless")
    assert "fused decoder-step kernels (sourceless) unavailable" in caplog.text
