"""Decoding on CUDA: the CPU's tokens in float32, float16 within a stated BLEU tolerance, and no
copy between host and device per decoder step but the one read of the finished flags.

The tests marked ``gpu`` are skipped without a CUDA device (tests/conftest.py) and run on a lent
GPU by ``bench.gpu_check``; the copy count also runs on the CPU (its helper and the decoding loop
it watches stay alive in CI, where the count is zero by construction).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model import checkpoint
from model.engine import loading
from model.engine.decoding import DecodeSession
from model.engine.options import DecodingOptions
from model.engine.translator import Translator, source_batch
from model.training.data import read_lines
from model.training.evaluate import score_translations
from tests.gpu.copies import count_copies, direction
from tests.helpers import ROOT

# Every shipped checkpoint folder this tree holds (on a lent GPU: those that travelled, docs/gpu.md).
MODELS = sorted(p for p in (ROOT / "weights").iterdir() if (p / checkpoint.CONFIG).is_file())
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SENTENCES = 64  # test_2016 sentences compared token for token
# float16 against float32 on CUDA, BLEU on the whole test_2016 set: rounding may flip a few
# sentences' choices, which moves a corpus BLEU of ~40 by tenths; a point is a broken path
HALF_BLEU_TOLERANCE = 1.0


def translator(folder: Path, device: str, precision: str) -> tuple[Translator, str]:
    """The folder's model on ``device`` as the service runs it (its shortlist, its first
    direction's prefix) -> the translator and that direction ("de-en")."""
    ckpt = loading.load(folder, device, precision)
    source, target = checkpoint.directions(ckpt.meta)[0]
    shortlist = loading.use_shortlist(ckpt)
    return Translator(ckpt.model, ckpt.tokenizer, ckpt.source_prefix(target), shortlist), f"{source}-{target}"


def test_the_copy_counter_sees_a_read_back_on_a_device_and_none_on_the_cpu() -> None:
    assert direction("Memcpy DtoH (Device -> Pageable)") == "DtoH"
    assert direction("Memcpy HtoD (Pinned -> Device)") == "HtoD"
    assert direction("Memcpy DtoD (Device -> Device)") is None
    assert direction("aten::copy_") is None
    copies = count_copies(lambda: torch.ones(3).tolist(), torch.device("cpu"))
    assert (copies.to_host, copies.to_device) == (0, 0)


@pytest.mark.gpu
def test_the_copy_counter_counts_a_read_back_and_a_send_on_cuda() -> None:
    """Without this, a count of zero below could be a profiler that sees nothing."""
    on_device = torch.ones(3, device="cuda")
    copies = count_copies(lambda: (on_device.tolist(), torch.tensor([1, 2]).to("cuda")), torch.device("cuda"))
    assert (copies.to_host, copies.to_device) == (1, 1), copies.table


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beam", [1, 4])
def test_a_decoder_step_copies_nothing_between_host_and_device_but_the_finished_flags(
    device: str, beam: int, shipped: Path, data_dir: Path, fused_kernels: None
) -> None:
    """Steady steps (nobody joins or finishes): at most one read back a step (which sentences are
    done, ``Beams.done_sentences``) and nothing sent. A read is a device sync, and per-step syncs
    are what keeps a GPU waiting on the host."""
    tr, _ = translator(shipped, device, "float32")
    lines = sorted(read_lines(data_dir / "test_2016_flickr.de.gz"), key=len)[-8:]  # long: none ends in 6 steps
    session = DecodeSession(tr.model, DecodingOptions(beam_size=beam), tr.shortlist)
    session.admit(source_batch(tr.model, tr.encode(lines)), range(len(lines)))
    for _ in range(2):  # the first steps widen the beams and lay the cache out
        assert not session.step()
    steps = 4

    def decode() -> None:
        for _ in range(steps):
            assert not session.step()

    copies = count_copies(decode, torch.device(device))
    assert copies.to_device == 0 and copies.to_host <= steps, copies.table


@pytest.mark.gpu
@pytest.mark.parametrize("folder", MODELS, ids=lambda p: p.name)
def test_cuda_float32_gives_the_cpus_tokens(folder: Path, data_dir: Path, fused_kernels: None) -> None:
    """Greedy and the card's beam, the shortlist where the folder has one: the same tokens as the
    CPU (its fused kernels) for every sentence, not merely the same score."""
    cpu, pair = translator(folder, "cpu", "float32")
    cuda, _ = translator(folder, "cuda", "float32")
    source = pair.split("-")[0]
    ids = cpu.encode(read_lines(data_dir / f"test_2016_flickr.{source}.gz")[:SENTENCES])
    meta = checkpoint.read_meta(folder)
    for beam in (1, None):
        options = loading.decoding_options(meta, beam, direction=pair)
        on_cpu = [h[0].ids for h in cpu.decode_ids(ids, options)]
        on_cuda = [h[0].ids for h in cuda.decode_ids(ids, options)]
        differ = [i for i, (a, b) in enumerate(zip(on_cpu, on_cuda, strict=True)) if a != b]
        assert not differ, f"{pair} beam {options.beam_size}: sentences {differ} differ"


@pytest.mark.gpu
def test_cuda_float16_scores_within_the_tolerance_of_float32(shipped: Path, data_dir: Path) -> None:
    src = read_lines(data_dir / "test_2016_flickr.de.gz")
    ref = read_lines(data_dir / "test_2016_flickr.en.gz")
    options = loading.decoding_options(checkpoint.read_meta(shipped), direction="de-en")
    bleu = {}
    for precision in ("float32", "float16"):
        tr, _ = translator(shipped, "cuda", precision)
        bleu[precision] = score_translations([t.text for t in tr.translate(src, options)], ref)["bleu"]
    assert abs(bleu["float16"] - bleu["float32"]) <= HALF_BLEU_TOLERANCE, bleu
