"""model.engine.kernels and model.network.linear: the kernel path chosen from CPU features, and each kernel's results.

Plans are built from simulated feature sets (an AVX2-only CPU, one without bf16, one without
AVX2), whatever machine the tests run on; kernels are run only under features this machine
really has (simulated & detected), so an AVX2-only CI machine runs the AVX2 paths for real.
"""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model.engine import fused, kernels, loading
from model.engine.features import AVX2_ONLY, AVX512_BF16, BASELINE, CpuFeatures, detected, fused_variant
from model.engine.kernels import UnsupportedPrecision, fbgemm_ops, onednn_ops
from model.network.linear import Linear, linear
from tests.factories import PACKED_FEATURES, assert_steps_match, packed_plan
from tests.helpers import require

pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("fused_kernels")]

HERE = detected()
SIMULATED = {"avx512-bf16": AVX512_BF16, "avx512-no-bf16": CpuFeatures(True, True, True, f16c=True), "avx2": AVX2_ONLY,
             "baseline": BASELINE, "intel-avx512-bf16": replace(AVX512_BF16, intel=True),
             "intel-avx2": replace(AVX2_ONLY, intel=True)}  # fmt: skip


def test_features_come_from_cpuinfo_flags_and_respect_isa_caps(tmp_path: Path) -> None:
    zen5 = "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni sse4_2"
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {zen5}\n\nprocessor\t: 1\nflags\t\t: {zen5}\n")
    assert CpuFeatures.detect(info, env={}) == AVX512_BF16
    assert CpuFeatures.detect(info, env={"ONEDNN_MAX_CPU_ISA": "AVX2"}) == AVX2_ONLY
    assert CpuFeatures.detect(info, env={"ATEN_CPU_CAPABILITY": "avx2"}) == AVX2_ONLY
    assert CpuFeatures.detect(info, env={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}) == AVX512_BF16
    assert CpuFeatures.detect(info, env={"ONEDNN_MAX_CPU_ISA": "SSE41"}) == BASELINE
    info.write_text("flags\t: fpu sse sse2 avx f16c avx2 fma\n")  # AMD EPYC Naples
    assert CpuFeatures.detect(info, env={}) == AVX2_ONLY and AVX2_ONLY.isa == "avx2"
    info.write_text(f"vendor_id\t: GenuineIntel\nflags\t\t: {zen5}\n")  # the vendor comes along, caps or not
    assert CpuFeatures.detect(info, env={}) == replace(AVX512_BF16, intel=True)
    assert CpuFeatures.detect(info, env={"ONEDNN_MAX_CPU_ISA": "AVX2"}) == replace(AVX2_ONLY, intel=True)
    info.write_text(f"vendor_id\t: AuthenticAMD\nflags\t\t: {zen5}\n")
    assert CpuFeatures.detect(info, env={}) == AVX512_BF16
    assert (AVX512_BF16 & AVX2_ONLY) == AVX2_ONLY


@pytest.mark.parametrize(
    ("cpu", "precision", "kernel", "warns"),
    [
        ("avx512-bf16", "float32", "onednn", False),
        ("avx2", "float32", "onednn", False),
        ("baseline", "float32", "aten", False),
        ("intel-avx512-bf16", "float32", "aten", False),  # MKL for every layer on Intel CPUs
        ("intel-avx2", "float32", "aten", False),
        ("avx512-bf16", "bfloat16", "onednn", False),
        ("avx512-no-bf16", "bfloat16", "onednn", True),  # emulated by oneDNN: works, logged
        ("avx2", "bfloat16", "aten", True),  # torch's oneDNN bf16 reorder would raise here
        ("avx2", "float16", "aten", True),
        ("avx512-bf16", "int8", "fbgemm-int8", False),
        ("avx2", "int8", "fbgemm-int8", False),
    ],
)
def test_plan_follows_the_capability_table(cpu: str, precision: str, kernel: str, warns: bool) -> None:
    """Without the fused kernels (off, or no compiler: ``test_float32_runs_on_panels_...``)."""
    plan = kernels.choose("cpu", precision, SIMULATED[cpu], engines=("fbgemm", "qnnpack"), fused=False)
    if not torch.backends.mkldnn.is_available() and kernel == "onednn":
        kernel = "aten"
    assert plan.kernel == kernel and plan.precision == precision
    assert (plan.warning is not None) == warns


@pytest.mark.parametrize("cpu", ["avx512-bf16", "avx2", "intel-avx512-bf16", "intel-avx2", "baseline"])
def test_float32_runs_on_panels_wherever_the_fused_kernels_can_build(
    cpu: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With a C++ compiler, float32 on any CPU with AVX2 and FMA, Intel's or not, runs its layers
    on the fused kernels' panels (``panels``); without one (``CXX`` not found, nothing built yet)
    the plan falls back to the table's (MKL on Intel, oneDNN elsewhere); the other precisions and
    a CPU without AVX2 never take panels."""
    features = SIMULATED[cpu]
    variant = fused_variant(features)
    if variant == "baseline":
        assert kernels.choose("cpu", "float32", features, fused=True).kernel == "aten"
        return
    require(fused.buildable(variant), "no C++ compiler: the fused kernels cannot build here")
    plan = kernels.choose("cpu", "float32", features, fused=True)
    assert plan.kernel == "panels" and plan.step == "panels" and plan.fused == variant
    assert plan.describe().startswith("float32 on cpu via panels, fused step kernels")
    assert kernels.choose("cpu", "int8", features, engines=("fbgemm",), fused=True).kernel == "fbgemm-int8"
    assert kernels.choose("cpu", "float32", features, fused=False).kernel != "panels"
    monkeypatch.setattr(fused, "_loaded", {})  # nothing built in this process or in the cache, no compiler found
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert not fused.buildable(variant)
    fallback = "aten" if features.intel or not torch.backends.mkldnn.is_available() else "onednn"
    assert kernels.choose("cpu", "float32", features, fused=True).kernel == fallback


@pytest.mark.parametrize(
    ("cpu", "step"),
    [
        ("avx512-bf16", "onednn"),
        ("avx2", "wx"),
        ("baseline", "aten"),
        ("intel-avx512-bf16", "aten"),
        ("intel-avx2", "aten"),
    ],
)
def test_decoder_step_layers_run_mkl_on_intel_and_wx_on_other_avx2_cpus(cpu: str, step: str) -> None:
    """float32's decoder step layers take MKL's sgemm where it was measured faster than oneDNN:
    ``aten`` (``F.linear``) on Intel CPUs, ``wx`` (W·xᵀ) on other AVX2 CPUs without AVX-512;
    elsewhere, and at every other precision, the plan's kernel."""
    plan = kernels.choose("cpu", "float32", SIMULATED[cpu], fused=False)
    if not torch.backends.mkldnn.is_available():
        step = "aten"
    assert plan.step == step
    assert ("decoder steps via wx" in plan.describe()) == (step == "wx")
    assert ("decoder steps via aten" in plan.describe()) == (step == "aten" and plan.kernel == "onednn")
    for precision in ("bfloat16", "float16", "int8"):
        try:
            other = kernels.choose("cpu", precision, SIMULATED[cpu], engines=("fbgemm",))
        except UnsupportedPrecision:
            continue
        assert other.step == other.kernel and other.step_kernel is None


@pytest.mark.parametrize("shape", [(5, 48), (1, 48), (4, 48), (3, 1, 48), (0, 48), (300, 48), (3, 7, 48)])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_wx_computes_f_linear_into_a_contiguous_result(shape: tuple[int, ...], relu: bool, bias: bool) -> None:
    """``wx`` (W·xᵀ, transposed back with the bias added) is F.linear at every row count, its
    result contiguous (the step views it), bound or not; another dtype gets F.linear's error."""
    torch.manual_seed(0)
    weight, b = torch.randn(70, 48), torch.randn(70) if bias else None
    x = torch.randn(shape)
    expected = F.linear(x, weight, b)
    expected = F.relu(expected) if relu else expected
    with torch.inference_mode():
        out = kernels.wx(x, weight, b, relu)
        bound = kernels.bind(kernels.wx, weight, b)(x.reshape(-1, 48), relu)
    assert out.shape == (*shape[:-1], 70) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(bound, out.reshape(-1, 70))
    with pytest.raises(RuntimeError):
        kernels.wx(x.double(), weight, b)


@pytest.mark.parametrize("rows", [1, 4, 0, 300])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_bound_aten_is_f_linear_to_the_bit(rows: int, relu: bool, bias: bool) -> None:
    """The bound ``aten`` kernel calls ``addmm``/``mm`` itself (no ``F.linear`` dispatch): the same
    numbers, bit for bit, and the same refusal of another dtype."""
    torch.manual_seed(1)
    weight, b = torch.randn(70, 48), torch.randn(70) if bias else None
    x = torch.randn(rows, 48)
    expected = F.linear(x, weight, b)
    expected = F.relu(expected) if relu else expected
    with torch.inference_mode():
        bound = kernels.bind(kernels.aten, weight, b)
        assert torch.equal(bound(x, relu), expected)
        with pytest.raises(RuntimeError):
            bound(x.double())


def test_bf16_training_runs_only_where_the_cpu_has_native_bf16() -> None:
    assert kernels.bf16_autocast("cpu", AVX512_BF16) is None
    assert kernels.bf16_autocast("cpu", CpuFeatures(avx2=True, fma=True, avx_ne_convert=True)) is None
    for cpu in ("avx512-no-bf16", "avx2", "baseline"):
        reason = kernels.bf16_autocast("cpu", SIMULATED[cpu])
        assert reason is not None and "emulated" in reason


def test_int8_reduces_activation_range_without_vnni() -> None:
    """fbgemm on AVX2 accumulates u8 x s8 pairs in 16 bits: 7-bit activations cannot saturate."""
    engines = ("fbgemm",)
    assert kernels.choose("cpu", "int8", AVX2_ONLY, engines).reduce_range
    assert not kernels.choose("cpu", "int8", AVX512_BF16, engines).reduce_range


@pytest.mark.parametrize(
    ("device", "precision", "features", "engines", "message"),
    [
        ("cpu", "int8", BASELINE, ("fbgemm",), "AVX2"),
        ("cpu", "int8", AVX2_ONLY, ("qnnpack",), "fbgemm"),
        ("cuda", "int8", AVX2_ONLY, ("fbgemm",), "CPU only"),
        ("cpu", "int4", AVX2_ONLY, ("fbgemm",), "not one of"),
    ],
)
def test_impossible_precisions_are_refused_naming_the_setting(
    device: str, precision: str, features: CpuFeatures, engines: tuple[str, ...], message: str
) -> None:
    with pytest.raises(UnsupportedPrecision, match=message) as err:
        kernels.choose(device, precision, features, engines)
    assert "TRANSLATOR_DTYPE" in str(err.value)


def _runnable(precision: str) -> list[str]:
    """Simulated CPUs whose plan for ``precision`` this machine can run."""
    out = []
    for name, features in SIMULATED.items():
        try:
            kernels.choose("cpu", precision, features & HERE)
        except UnsupportedPrecision:
            continue
        out.append(name)
    return out


@pytest.mark.parametrize("cpu", _runnable("float32"))
@pytest.mark.parametrize("precision", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(5, 48), (1, 48), (3, 1, 48), (0, 48), (70, 48), (9, 48), (3, 7, 48)])
@pytest.mark.parametrize("relu", [False, True])
def test_float_kernels_match_f_linear(cpu: str, precision: str, shape: tuple[int, ...], relu: bool) -> None:
    plan = kernels.choose("cpu", precision, SIMULATED[cpu] & HERE)
    torch.manual_seed(0)
    layer = kernels.install(Linear(48, 70).to(plan.dtype), plan)
    x = torch.randn(shape, dtype=plan.dtype)
    with torch.inference_mode():
        out = layer(x, relu=relu)
        expected = F.linear(x, layer.weight, layer.bias)
        expected = F.relu(expected) if relu else expected
    assert out.shape == (*shape[:-1], 70) and out.dtype == plan.dtype
    tol = 1e-5 if precision == "float32" else 2e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", [(5, 48), (1, 48), (3, 1, 48), (0, 48), (300, 48), (3, 7, 48)])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_a_released_float32_layer_matches_f_linear(shape: tuple[int, ...], relu: bool, bias: bool) -> None:
    """Once its float weight is released, a float32 oneDNN layer (``PackedOneDNN``) computes
    F.linear at every row count, one row included, bound or not, and refuses another dtype."""
    plan = kernels.choose("cpu", "float32", PACKED_FEATURES, fused=False)
    if plan.kernel != "onednn":
        pytest.skip(f"float32 runs {plan.kernel} on this CPU: nothing is packed, nothing released")
    torch.manual_seed(0)
    layer = kernels.install(Linear(48, 70, bias=bias), plan)
    weight, b = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    x = torch.randn(shape)
    expected = F.linear(x, weight, b)
    expected = F.relu(expected) if relu else expected
    with torch.inference_mode():
        released = kernels.release_float_weights(layer)
        assert released == 4 * 48 * 70 and layer.weight.is_meta and isinstance(layer.kernel, kernels.PackedOneDNN)
        assert bias == (layer.bias is not None and not layer.bias.is_meta)
        out = layer(x, relu=relu)
        bound = kernels.bind(layer.kernel, layer.weight, layer.bias)(x.reshape(-1, 48), relu)
        with pytest.raises(RuntimeError, match=r"expected torch\.float32 input"):
            layer(x.double())
    assert out.shape == (*shape[:-1], 70) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(bound, out.reshape(-1, 70))


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("out_features", [70, onednn_ops.ATEN_MAX_OUT + 1])
def test_a_bound_kernel_gives_what_the_kernel_gives(precision: str, out_features: int) -> None:
    """``kernels.bind`` (weights looked up once, for the decoder step) = the layer's kernel, at
    every row count the step sees (one row takes F.linear below ATEN_MAX_OUT, padded buckets
    above EXACT_ROWS), with and without ReLU; and the unplanned ``auto`` binds too."""
    try:
        plan = kernels.choose("cpu", precision)
    except UnsupportedPrecision:
        pytest.skip(f"{precision} does not run on this CPU")
    torch.manual_seed(0)
    dtype = plan.dtype if precision != "int8" else torch.float32
    layer = kernels.install(Linear(48, out_features).to(dtype), plan)
    with torch.inference_mode():
        bound = kernels.bind(layer.kernel, layer.weight, layer.bias)
        unplanned = kernels.bind(kernels.auto, layer.weight, layer.bias)
        for rows in (1, 4, 9, 70, 300):
            x = torch.randn(rows, 48, dtype=dtype)
            for relu in (False, True):
                assert torch.equal(bound(x, relu), layer.kernel(x, layer.weight, layer.bias, relu))
                if precision != "int8":
                    assert torch.equal(unplanned(x, relu), kernels.auto(x, layer.weight, layer.bias, relu))


def test_row_buckets_are_few_and_waste_at_most_half() -> None:
    """oneDNN sees few row counts (one primitive each), none half again the real one or more."""
    sizes = [kernels.bucket_rows(r) for r in range(1, 5000)]
    assert all(r <= s < 1.5 * r for r, s in enumerate(sizes, 1))
    assert sizes == sorted(sizes) and sizes[: onednn_ops.EXACT_ROWS] == list(range(1, onednn_ops.EXACT_ROWS + 1))
    assert all(kernels.bucket_rows(s) == s for s in sizes)  # a bucket is its own bucket
    expected = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert sorted(set(sizes[: kernels.ONEDNN_MAX_ROWS])) == expected
    assert kernels.bucket_rows(kernels.ONEDNN_MAX_ROWS) == kernels.ONEDNN_MAX_ROWS  # no padding crosses it


def test_more_rows_than_onednn_takes_run_in_chunks_of_known_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ONEDNN_MAX_ROWS (the encoder's sentences x tokens) a layer runs in chunks of
    ONEDNN_MAX_ROWS rows and one bucket for the rest, bound or not, released or not: oneDNN only
    ever sees bucket sizes up to the limit (so those varying shapes build no new primitive), and
    the result is F.linear's."""
    plan = kernels.choose("cpu", "float32", PACKED_FEATURES, fused=False)
    if plan.kernel != "onednn":
        pytest.skip(f"float32 runs {plan.kernel} on this CPU, not oneDNN")
    torch.manual_seed(0)
    layer = kernels.install(Linear(48, 70), plan)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    matmul = onednn_ops._matmul
    calls: list[int] = []

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return matmul(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(onednn_ops, "_matmul", counted)
    limit = kernels.ONEDNN_MAX_ROWS
    with torch.inference_mode():
        bound = kernels.bind(layer.kernel, layer.weight, layer.bias)
        x = torch.randn(2 * limit + 5, 48)
        expected = F.relu(F.linear(x, weight, bias))
        torch.testing.assert_close(layer.kernel(x, layer.weight, layer.bias, True), expected)
        torch.testing.assert_close(bound(x, True), expected)
        assert calls == [limit, limit, kernels.bucket_rows(5)] * 2
        calls.clear()
        kernels.release_float_weights(layer)
        assert layer.weight.is_meta and isinstance(layer.kernel, kernels.PackedOneDNN)
        x = torch.randn(3000, 48)
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias))
        bound = kernels.bind(layer.kernel, layer.weight, layer.bias)
        torch.testing.assert_close(bound(x, False), F.linear(x, weight, bias))
        assert set(calls) <= set(map(kernels.bucket_rows, range(1, limit + 1))) and max(calls) == limit
        assert layer(torch.randn(0, 48)).shape == (0, 70)


@pytest.mark.parametrize("fused_step", [True, False])
@pytest.mark.parametrize("cpu", ["not-intel", "avx2", "intel"])
def test_float32_load_keeps_one_copy_of_the_weights_and_translates_as_before(
    tiny_weights_dir: Path, cpu: str, fused_step: bool
) -> None:
    """A loaded checkpoint's linear layers keep one copy of their weights. With the fused kernels
    (the plan on ``panels``), every layer keeps only its panels (``PackedPanels``), the output
    projection too, and the tied token lookups read them. Without them,
    where float32 runs on oneDNN: the packed copy only (float weights released, biases and the
    embeddings the output projection shares kept), except the decoder step's layers where they run
    ``wx``, which keep their float weights and no packed copy; on Intel CPUs (MKL, ``aten``) the
    float weights. Each translates as the same model with its float weights;
    ``keep_float_weights`` keeps them. On this CPU said not to be Intel's, on a simulated AVX2 one
    and on this one said to be Intel's."""
    from model.engine.options import DecodingOptions
    from model.engine.translator import Translator

    folder = tiny_weights_dir / "de-en"
    features = {"not-intel": replace(HERE, intel=False), "avx2": AVX2_ONLY & HERE, "intel": replace(HERE, intel=True)}
    ckpt = loading.load(folder, "cpu", "float32", features[cpu], fused=fused_step)
    kept = loading.load(folder, "cpu", "float32", features[cpu], keep_float_weights=True, fused=fused_step)
    layers = [m for m in ckpt.model.modules() if isinstance(m, Linear)]
    assert not any(p.is_meta for p in kept.model.parameters())
    if ckpt.plan.kernel in ("panels", "aten"):  # the fused kernels' panels, or MKL: Intel's, or no oneDNN
        assert ckpt.plan.step == ckpt.plan.kernel
        assert ckpt.plan.kernel == "panels" or features[cpu].intel or not torch.backends.mkldnn.is_available()
        panels = kernels.panel_kernels(ckpt.plan)
        assert (panels is not None) == (ckpt.plan.kernel == "panels") == fused_step
        packed = [m for m in layers if isinstance(m.kernel, kernels.PackedPanels)]
        width = 0 if panels is None else panels.panel_width()
        assert [m for m in layers if width] == packed  # (any width: a last panel is padded)
        assert all(m.weight.is_meta for m in packed)
        assert all(m.kernel is kernels.aten and not m.weight.is_meta for m in layers if m not in packed)
        # the output projection on panels too, the tied lookups reading them; else MKL on the rows
        assert ckpt.model.output_matrix().is_meta == (panels is not None)
        assert isinstance(ckpt.model.kernel, kernels.PackedPanels) if panels else ckpt.model.kernel is kernels.aten
        assert bool(packed) == (panels is not None and ckpt.model.fused_step is not None)
    else:
        step = ckpt.model.step_linears()
        assert len(step) == 6 * ckpt.model.config.decoder_layers
        expected = "wx" if not features[cpu].avx512 else "onednn"
        assert ckpt.plan.step == expected
        on_mkl = step if expected != "onednn" else []
        packed = [m for m in layers if all(m is not w for w in on_mkl)]
        assert packed and all(isinstance(m.kernel, kernels.PackedOneDNN) and m.weight.is_meta for m in packed)
        assert all(m.kernel is kernels.wx and not m.weight.is_meta for m in on_mkl)
        assert not on_mkl or all(m.kernel is kernels.wx for m in kept.model.step_linears())
        assert not any(m.bias.is_meta for m in layers) and not ckpt.model.output_matrix().is_meta
        packed_bytes = sum(m.weight.numel() * 4 for m in packed)
        float_bytes = sum(p.numel() * p.element_size() for p in ckpt.model.parameters() if not p.is_meta)
        kept_bytes = sum(p.numel() * p.element_size() for p in kept.model.parameters())
        assert float_bytes <= kept_bytes - packed_bytes  # the packed layers' float copies are gone
    texts = ["ein Hund läuft", "zwei Männer spielen Fußball im Park", "x"]
    ids = ckpt.tokenizer.encode(texts)
    for beam in (1, 3):
        options = DecodingOptions(beam_size=beam, max_length=12)
        ours = Translator(ckpt.model, ckpt.tokenizer).decode_ids(ids, options)
        reference = Translator(kept.model, kept.tokenizer).decode_ids(ids, options)
        assert [[h.ids for h in hyps] for hyps in ours] == [[h.ids for h in hyps] for hyps in reference]
    if packed:
        with pytest.raises(RuntimeError, match="released for inference"):
            packed[0](torch.randn(2, packed[0].in_features))  # gradients enabled: not the kernel's path


@pytest.mark.parametrize("step", ["wx", "aten"])
def test_the_decoder_step_on_mkl_gives_the_networks_logits(tiny_weights_dir: Path, step: str) -> None:
    """Decoder steps whose layers run ``wx`` (a simulated AVX2 CPU) or ``aten`` (this one said to
    be Intel's), the other layers packed, give the logits of the same checkpoint's teacher-forced
    decoder run on ``F.linear`` (float weights kept, gradients off outside inference mode: the
    modules' reference path), step by step."""
    folder = tiny_weights_dir / "de-en"
    features = AVX2_ONLY & HERE if step == "wx" else replace(HERE, intel=True)
    ckpt = loading.load(folder, "cpu", "float32", features, fused=False)  # (with them: panels)
    reference = loading.load(folder, "cpu", "float32", keep_float_weights=True).model
    if ckpt.plan.step != step:
        pytest.skip(f"float32 runs {ckpt.plan.describe()} here")
    model = ckpt.model
    src = torch.tensor([ckpt.tokenizer.encode(["zwei Männer spielen Fußball im Park"])[0]])
    tgt = torch.tensor([[model.config.bos_id, 17, 230, 45, 9, 120]])
    with torch.no_grad():
        memory, mask, _ = reference.encode(src)
        expected = reference.decode(tgt, memory, mask)[0]  # (1, T, V)
    with torch.inference_mode():
        assert_steps_match(model, src, tgt, expected, tol=1e-4)


@pytest.mark.parametrize("cpu", _runnable("int8"))
def test_int8_kernel_is_close_to_float32(cpu: str) -> None:
    plan = kernels.choose("cpu", "int8", SIMULATED[cpu] & HERE)
    torch.manual_seed(0)
    layer = kernels.install(Linear(256, 300), plan)
    x = torch.randn(64, 256)
    with torch.inference_mode():
        out = layer(x)
        expected = F.linear(x, layer.weight, layer.bias)
        fused = layer(x, relu=True)
    torch.testing.assert_close(fused, F.relu(out))
    assert out.dtype == torch.float32 and out.shape == expected.shape
    rel = (out - expected).norm() / expected.norm()
    assert rel < 0.02, rel  # 8-bit weights and activations: ~1% relative error
    assert not torch.equal(out, expected)  # it really ran in int8


@pytest.mark.parametrize("precision", [p for p in ("float32", "int8") if _runnable(p)])
def test_packed_copy_follows_in_place_updates_and_is_freed(precision: str) -> None:
    plan = kernels.choose("cpu", precision, fused=False)  # (float32 with the fused kernels: F.linear until released)
    cache = fbgemm_ops._int8_packed if precision == "int8" else onednn_ops._onednn_packed
    torch.manual_seed(1)
    layer = kernels.install(Linear(16, 8, bias=False), plan)
    x = torch.randn(4, 16)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(-2.0)  # what an optimizer step does: in place, version bumped
        after = layer(x)
    tol = 1e-5 if precision == "float32" else 5e-2
    torch.testing.assert_close(after, before * -2.0, atol=tol, rtol=tol)
    if plan.kernel != "aten":
        key = id(layer.weight)
        assert key in cache.entries
        del layer
        gc.collect()
        assert key not in cache.entries


def test_training_path_has_gradients() -> None:
    layer = kernels.install(Linear(6, 3), kernels.choose("cpu", "float32"))
    x = torch.randn(2, 6, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and x.grad is not None
    torch.testing.assert_close(layer.weight.grad, torch.ones(3, 1) * x.detach().sum(0))
    assert linear(x, layer.weight).requires_grad


def test_autocast_regions_keep_f_linear_semantics() -> None:
    """The trainer validates under CPU bf16 autocast with no gradients: inputs are cast as usual."""
    torch.manual_seed(2)
    first, second = Linear(16, 32), Linear(32, 8)
    x = torch.randn(3, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = first(x)
        out = second(torch.relu(h))
        expected = F.linear(torch.relu(F.linear(x, first.weight, first.bias)), second.weight, second.bias)
    assert h.dtype == out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)
    with torch.no_grad(), pytest.raises(RuntimeError):  # mixed dtypes, no autocast: F.linear's error
        second(h)


def test_load_installs_the_plan_and_refuses_before_reading(tiny_weights_dir: Path, tmp_path: Path) -> None:
    folder = tiny_weights_dir / "de-en"
    ckpt = loading.load(folder, "cpu", "bfloat16", AVX2_ONLY & HERE)
    assert ckpt.plan.kernel == "aten" and ckpt.model.output_matrix().dtype == torch.bfloat16
    assert all(m.kernel is kernels.aten for m in ckpt.model.modules() if isinstance(m, Linear))
    with pytest.raises(UnsupportedPrecision):
        loading.load(tmp_path / "does-not-exist", "cpu", "int8", BASELINE)


@pytest.mark.skipif(not _runnable("int8"), reason="int8 needs AVX2 and fbgemm")
def test_int8_load_keeps_one_copy_of_the_weights_and_decodes_as_before(tiny_weights_dir: Path) -> None:
    """An int8 checkpoint holds its linear layers as packed int8 only (fbgemm's or the fused kernels'
    panels; float weights released; the embeddings the output projection shares read from its
    int8 panels where they hold it); it translates exactly as the same plan with the float
    weights still there (the table as the lookups read it), and refuses to run a released layer
    outside inference."""
    from model.engine.options import DecodingOptions
    from model.engine.translator import Translator

    folder = tiny_weights_dir / "de-en"
    ckpt = loading.load(folder, "cpu", "int8")
    layers = [m for m in ckpt.model.modules() if isinstance(m, Linear)]
    # the one copy: the fused kernels' int8 panels where they take every int8 product (AVX2), else fbgemm's
    packed = kernels.PackedInt8 if kernels.int8_kernels(ckpt.plan) is None else kernels.PackedInt8Panels
    assert layers and all(isinstance(m.kernel, packed) and m.weight.is_meta for m in layers)
    # the output projection too (its vocabulary of 1,000 no multiple of 16: the last panel padded)
    assert isinstance(ckpt.model.kernel, packed)
    # the tied table (float32, not exact in float16): read from the int8 panels where they hold
    # it, as CTranslate2 reads an int8 model's embeddings; beside fbgemm's copy, the float rows
    embedding = ckpt.model.output_matrix()
    assert embedding.is_meta == (packed is kernels.PackedInt8Panels)
    assert embedding.is_meta or embedding.untyped_storage().nbytes() == embedding.numel() * 4
    float_bytes = sum(p.numel() * p.element_size() for p in ckpt.model.parameters() if not p.is_meta)
    assert float_bytes < 0.5 * ckpt.model.num_parameters() * 4  # the layers' float copies are gone
    kept = loading.load(folder, "cpu", "float32", keep_float_weights=True)
    kernels.install(kept.model, ckpt.plan)  # same int8 plan, float weights kept
    if embedding.is_meta:  # the same table rows as the lookups read (the projection requantizes them to the same)
        table = ckpt.model.tgt_embed.lookup
        assert isinstance(table, kernels.TokenTable) and table.data.dtype == torch.int8
        with torch.no_grad():
            kept.model.tgt_embed.tokens.weight.copy_(table(torch.arange(ckpt.config.tgt_vocab_size)))
    texts = ["ein Hund läuft", "zwei Männer spielen Fußball im Park", "x"]
    for beam in (1, 3):
        options = DecodingOptions(beam_size=beam, max_length=12)
        ids = ckpt.tokenizer.encode(texts)
        ours = Translator(ckpt.model, ckpt.tokenizer).decode_ids(ids, options)
        reference = Translator(kept.model, kept.tokenizer).decode_ids(ids, options)
        assert [[h.ids for h in hyps] for hyps in ours] == [[h.ids for h in hyps] for hyps in reference]
    with pytest.raises(RuntimeError, match="released for inference"):
        layers[0](torch.randn(2, layers[0].in_features))  # gradients enabled: not the kernel's path


@pytest.mark.parametrize("precision", ["int8", "float32"])
@pytest.mark.parametrize("tied", [True, False])
def test_releasing_float_weights_keeps_what_is_read_elsewhere(tied: bool, precision: str) -> None:
    """The output projection (the embeddings when tied, its own layer when not) is run by the
    model's kernel on the float matrix, so it stays; every other int8 layer gives its float
    weight and bias up, every float32 oneDNN layer its weight (its bias stays, in the kernel),
    and the network computes exactly what it computed before."""
    from model.network.config import ModelConfig
    from model.network.transformer import Transformer

    plan = packed_plan(precision)
    torch.manual_seed(5)
    cfg = ModelConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=32, n_heads=2, encoder_layers=1,
                      decoder_layers=1, d_ff=64, share_embeddings=tied)  # fmt: skip
    model = kernels.install(Transformer(cfg).eval(), plan)
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    with torch.inference_mode():
        before = model(src, tgt)
        released = kernels.release_float_weights(model, keep=[model.output_matrix()])
        after = model(src, tgt)
    assert torch.equal(before, after)
    assert not model.output_matrix().is_meta
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert [m.weight.is_meta for m in layers] == [m.weight is not model.output_matrix() for m in layers]
    bias_released = precision == "int8"
    biased = [m for m in layers if m.bias is not None]
    assert [m.bias.is_meta for m in biased] == [bias_released and m.weight.is_meta for m in biased]
    assert released == sum(4 * (m.weight.numel() + bias_released * m.bias.numel()) for m in layers if m.weight.is_meta)


@pytest.mark.skipif(not _runnable("int8"), reason="int8 needs AVX2 and fbgemm")
def test_int8_layers_released_onto_the_fused_kernels_panels_run_them_everywhere() -> None:
    """Given the fused kernels that take every int8 product (``int8_kernels``: AVX2), released int8
    layers keep those kernels' int8 panels alone (``PackedInt8Panels``, fbgemm's quantized weight),
    and the modules' own path (the teacher-forced pass ``/attention`` runs) computes with them what
    the decoding passes compute: the same as fbgemm to within int8's error, on 3-d inputs as well."""
    from model.network.config import ModelConfig
    from model.network.transformer import Transformer

    plan = kernels.choose("cpu", "int8")
    fused_int8 = kernels.int8_kernels(plan)
    if fused_int8 is None:
        pytest.skip(f"{plan.describe()}: the fused kernels do not take every int8 product here")
    torch.manual_seed(5)
    cfg = ModelConfig(src_vocab_size=64, tgt_vocab_size=64, d_model=32, n_heads=2, encoder_layers=1,
                      decoder_layers=1, d_ff=64)  # fmt: skip
    model = kernels.install(Transformer(cfg).eval(), plan)
    src, tgt = torch.randint(4, 64, (3, 7)), torch.randint(4, 64, (3, 5))
    with torch.inference_mode():
        fbgemm = model(src, tgt)
        exact = kernels.install(Transformer(cfg).eval(), kernels.choose("cpu", "float32"))
        exact.load_state_dict(model.state_dict())
        floats = exact(src, tgt)
        released = kernels.release_float_weights(model, keep=[model.output_matrix()], int8=fused_int8)
        ours = model(src, tgt)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(isinstance(m.kernel, kernels.PackedInt8Panels) and m.weight.is_meta for m in layers)
    assert released == sum(4 * (m.weight.numel() + m.bias.numel()) for m in layers)
    assert ours.shape == fbgemm.shape and not torch.equal(ours, fbgemm)  # each row quantized apart
    scale = floats.abs().max().item()
    for result in (ours, fbgemm):
        assert (result - floats).abs().max().item() < 0.1 * scale
    layer = layers[0]
    x = torch.randn(2, 3, layer.in_features)
    with torch.inference_mode():
        three_d = layer(x)
        assert torch.equal(three_d.reshape(6, -1), layer.kernel.run(x.reshape(6, -1)))
        assert torch.equal(layer(x.double()), three_d.double())  # computed from float32, in the input's dtype
