"""Imported OPUS-MT (Marian) folders compute transformers' function to the token.

A ``MarianMTModel`` of a small ``MarianConfig`` (swish, scaled embeddings, an output bias, PAD as
the decoder's start, a sentencepiece model trained here: ``tests.factories.marian_folder``),
saved with ``save_pretrained``, imported with ``translator import``: its logits match
transformers' to float rounding, and greedy and beam search give ``generate``'s tokens on a few
hundred sentences, on the fused kernels and on the tensor operations. Then the service serves it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from app.settings import Settings
from model.engine import kernels, loading
from model.engine.batches import pad
from model.engine.options import DecodingOptions
from model.engine.translator import Translator
from model.imports import UnsupportedModel
from model.imports import main as import_main
from model.imports import read as import_read
from model.training.data import read_lines
from tests.factories import start

LIMIT = 10  # generated tokens per sentence
PAD, EOS = 300, 0  # marian_folder's: <pad> after the 300 pieces, </s> first


@pytest.fixture(scope="module")
def sentences(data_dir: Path) -> list[str]:
    return read_lines(data_dir / "val.de.gz")[:200]


def transformers_model(marian_dir: Path, pad_logit: bool) -> Any:
    """The folder as transformers loads it; ``pad_logit``: PAD banned by an output bias of -inf
    (what the import does, and transformers 4's Marian) instead of transformers 5's
    ``bad_words_ids`` after the softmax (the same greedy choices; beam scores differ by PAD's
    probability)."""
    from transformers import MarianMTModel

    marian = MarianMTModel.from_pretrained(str(marian_dir)).eval()
    if pad_logit:
        with torch.no_grad():
            marian.final_logits_bias[0, PAD] = -math.inf
        marian.generation_config.bad_words_ids = None
    return marian


def source_batch(ids: list[list[int]]) -> torch.Tensor:
    return pad([[*row, EOS] for row in ids], PAD)


def test_import_writes_a_card_and_the_options(imported: Path) -> None:
    meta = json.loads((imported / "config.json").read_text())
    model = meta["model"]
    assert (model["activation"], model["scale_embeddings"], model["output_bias"]) == ("swish", True, True)
    assert (model["bos_id"], model["pad_id"], model["eos_id"]) == (PAD, PAD, EOS)
    assert meta["tokenizer"]["type"] == "vocabulary" and meta["decoding"]["beam_size"] == 4
    card = (imported / "README.md").read_text()
    assert "Not trained here" in card and "OPUS-MT (Marian)" in card and "swish" in card


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "tensor-ops"])
def test_logits_match_transformers(
    imported: Path, marian_dir: Path, sentences: list[str], fused: bool, fused_kernels: None
) -> None:
    ckpt = loading.load(imported, keep_float_weights=True, fused=fused)
    src = source_batch(ckpt.tokenizer.encode(sentences[:40]))
    tgt = torch.cat([torch.full((40, 1), PAD), src[:, :8].clamp(max=PAD - 1)], dim=1)  # PAD starts, then pieces
    marian = transformers_model(marian_dir, pad_logit=False)
    with torch.inference_mode():
        theirs = marian(input_ids=src, attention_mask=src.ne(PAD).long(), decoder_input_ids=tgt).logits
        ours = ckpt.model(src, tgt)
    assert torch.isinf(ours[..., PAD]).all()  # banned: bad_words_ids became -inf in the bias
    theirs = theirs.clone()
    theirs[..., PAD] = -math.inf
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def generated(marian: Any, src: torch.Tensor, beam: int) -> list[tuple[int, ...]]:
    extra = {"num_beams": beam, "length_penalty": 0.0} if beam > 1 else {"num_beams": 1}
    with torch.inference_mode():
        rows = marian.generate(
            input_ids=src, attention_mask=src.ne(PAD).long(), max_new_tokens=LIMIT, do_sample=False, **extra
        ).tolist()
    out = []
    for row in rows:
        row = row[1:]  # (the start, PAD)
        row = row[: row.index(EOS)] if EOS in row else [t for t in row if t != PAD]
        out.append(tuple(row))
    return out


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "tensor-ops"])
@pytest.mark.parametrize("beam", [1, 4])
def test_outputs_are_generates(
    imported: Path, marian_dir: Path, sentences: list[str], beam: int, fused: bool, fused_kernels: None
) -> None:
    ckpt = loading.load(imported, fused=fused)
    assert (ckpt.model.fused_step is not None) == (fused and ckpt.model.fused_step is not None)
    ids = ckpt.tokenizer.encode(sentences)
    options = DecodingOptions(beam_size=beam, length_penalty=0.0, max_length_a=0.0, max_length_b=LIMIT)
    ours = [h[0].ids for h in Translator(ckpt.model, ckpt.tokenizer).decode_ids(ids, options)]
    # greedy: transformers' own bad_words_ids; beam: PAD's logit at -inf, as the import has it
    theirs = generated(transformers_model(marian_dir, pad_logit=beam > 1), source_batch(ids), beam)
    assert len(set(ours)) > len(ours) // 4  # (the random model says different things to different sentences)
    assert sum(len(row) < LIMIT for row in ours) > 10  # (and ends some early)
    assert ours == theirs


def test_text_round_trip_is_marians(imported: Path, marian_dir: Path, sentences: list[str]) -> None:
    """The import's tokenizer gives MarianTokenizer's ids and texts."""
    from transformers import MarianTokenizer

    theirs = MarianTokenizer(
        str(marian_dir / "source.spm"), str(marian_dir / "target.spm"), str(marian_dir / "vocab.json")
    )
    ckpt = loading.load(imported)
    ours = ckpt.tokenizer.encode(sentences[:50])
    assert [[*row, EOS] for row in ours] == [theirs(s)["input_ids"] for s in sentences[:50]]
    assert ckpt.tokenizer.decode(ours) == [theirs.decode(row, skip_special_tokens=True) for row in ours]


def changed_config(marian_dir: Path, tmp_path: Path, **changes: Any) -> Path:
    folder = tmp_path / "changed"
    folder.mkdir()
    for file in marian_dir.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"activation_function": "gelu_new"}, "activation_function 'gelu_new'"),
        ({"decoder_ffn_dim": 128}, "encoder_ffn_dim 64 != decoder_ffn_dim 128"),
        ({"normalize_embedding": True}, "normalize_embedding"),
    ],
)
def test_what_cannot_run_exactly_is_refused_by_name(
    marian_dir: Path, tmp_path: Path, changes: dict[str, Any], named: str
) -> None:
    folder = changed_config(marian_dir, tmp_path, **changes)
    with pytest.raises(UnsupportedModel, match=named.replace("(", r"\(")):
        import_read(folder, tmp_path / "de-en")


def test_a_folder_of_no_known_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="neither a Marian folder"):
        import_main([str(tmp_path), "--out", str(tmp_path / "de-en")])


@pytest.fixture(scope="module")
def client(imported: Path) -> Iterator[TestClient]:
    yield from start(Settings(weights_dir=imported.parent))


def test_served_like_a_shipped_direction(client: TestClient, imported: Path, sentences: list[str]) -> None:
    languages = client.get("/languages").json()
    assert {"code": "de", "name": "German", "targets": ["en"]} in languages
    ckpt = loading.load(imported)
    options = loading.decoding_options(ckpt.meta)
    expected = Translator(ckpt.model, ckpt.tokenizer).translate(sentences[:3], options)
    answer = client.post("/translate", json={"q": sentences[:3], "source": "de", "target": "en"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["translatedText"] == [t.text for t in expected]
    maps = client.post("/attention", json={"q": sentences[0], "source": "de", "target": "en"})
    assert maps.status_code == 200, maps.text
    body = maps.json()
    assert body["source_tokens"][-1] == "</s>" and body["translatedText"] == expected[0].text
    assert len(body["attention"]["cross"][0][0]) == len(body["target_tokens"])
    words = client.post("/attention", json={"q": sentences[0], "source": "de", "target": "en", "level": "word"})
    assert words.status_code == 200, words.text
    assert words.json()["source_tokens"][:3] == sentences[0].split()[:3]  # spans of the imported pieces


def test_runs_in_int8_like_a_shipped_model(imported: Path, sentences: list[str]) -> None:
    """int8 (the engine's own quantization) takes the imported options too: the output bias, swish."""
    try:
        ckpt = loading.load(imported, precision="int8")
    except kernels.UnsupportedPrecision:
        pytest.skip("int8 does not run on this CPU")
    options = DecodingOptions(beam_size=2, max_length_a=0.0, max_length_b=LIMIT)
    out = Translator(ckpt.model, ckpt.tokenizer).translate(sentences[:8], options)
    assert all(PAD not in ckpt.tokenizer.encode([t.text])[0] for t in out)
    assert ckpt.model.output_bias is not None and torch.isinf(ckpt.model.output_bias[PAD])
