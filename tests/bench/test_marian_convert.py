"""Marian mapping: transformers' MarianMTModel computes our function with our weights."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from model.engine.batches import pad
from model.engine.options import DecodingOptions
from model.engine.translator import Translator
from model.network.tokenizer import Tokenizer
from model.network.transformer import Transformer
from model.training.data import read_lines
from tests.factories import random_model
from tests.helpers import require

LIMIT = 20


@pytest.fixture(scope="module")
def mc() -> ModuleType:
    """``bench.marian_convert``, imported only when ``transformers`` is there (CI requires it)."""
    require(importlib.util.find_spec("transformers") is not None, "transformers is not installed (dev extra)")
    return importlib.import_module("bench.marian_convert")


@pytest.fixture(scope="module")
def sources(data_dir: Path) -> list[str]:
    return read_lines(data_dir / "test_2016_flickr.de.gz")[:12]


@pytest.fixture(scope="module", params=["post-ln", "post-ln-eos", "untied-learned"])
def model(request: pytest.FixtureRequest, tiny_tokenizer: Tokenizer) -> Transformer:
    variants: dict[str, dict[str, Any]] = {
        "post-ln": {},
        "post-ln-eos": {"eos_scale": 12.0},
        "untied-learned": {"share_embeddings": False, "positions": "learned"},
    }
    return random_model(tiny_tokenizer.vocab_size, **variants[request.param])


def source_batch(tokenizer: Tokenizer, sentences: list[str]) -> torch.Tensor:
    return pad([[*ids, 3] for ids in tokenizer.encode(sentences)], 0)


def test_teacher_forced_logits_match(
    mc: ModuleType, model: Transformer, tiny_tokenizer: Tokenizer, data_dir: Path
) -> None:
    src = source_batch(tiny_tokenizer, read_lines(data_dir / "test_2016_flickr.de.gz")[:6])
    refs = tiny_tokenizer.encode(read_lines(data_dir / "test_2016_flickr.en.gz")[:6])
    tgt = pad([[2, *ids] for ids in refs], 0)  # BOS + reference, padded
    marian = mc.to_marian(model)
    with torch.inference_mode():
        ours = model(src, tgt)
        theirs = marian(input_ids=src, attention_mask=src.ne(0).long(), decoder_input_ids=tgt).logits
    real = tgt.ne(0)  # padded positions are never read
    torch.testing.assert_close(theirs[real], ours[real], atol=1e-4, rtol=0)


def generated(marian: Any, src: torch.Tensor, **kwargs: Any) -> list[tuple[int, ...]]:
    rows = marian.generate(input_ids=src, attention_mask=src.ne(0).long(), max_new_tokens=LIMIT, **kwargs).tolist()
    return [tuple(row[1 : row.index(3)] if 3 in row else row[1:]) for row in rows]


@pytest.mark.parametrize("beam", [1, 4])
def test_generate_gives_our_tokens(
    mc: ModuleType, model: Transformer, tiny_tokenizer: Tokenizer, sources: list[str], beam: int
) -> None:
    options = DecodingOptions(beam_size=beam, length_penalty=0.0, max_length_a=0.0, max_length_b=LIMIT)
    ours = [h[0].ids for h in Translator(model, tiny_tokenizer).decode_ids(tiny_tokenizer.encode(sources), options)]
    beam_args = {"num_beams": beam, "length_penalty": 0.0} if beam > 1 else {}
    theirs = generated(mc.to_marian(model), source_batch(tiny_tokenizer, sources), **beam_args)
    assert theirs == ours


def test_pre_ln_is_refused_with_a_clear_error(mc: ModuleType, tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(mc.UnsupportedModel, match=r"post-LN only.*pre-LN"):
        mc.to_marian(random_model(tiny_tokenizer.vocab_size, norm_first=True))


def test_saved_folder_reloads_with_transformers_own_position_table(
    mc: ModuleType, tmp_path: Path, tiny_weights_dir: Path, tiny_tokenizer: Tokenizer
) -> None:
    """save_pretrained drops the sinusoidal table; transformers rebuilds it, equal to ours."""
    from transformers import MarianMTModel

    from model.engine import loading

    mc.main(["--weights", str(tiny_weights_dir / "de-en"), "--out", str(tmp_path / "marian")])
    reloaded = MarianMTModel.from_pretrained(str(tmp_path / "marian")).eval()
    ours = loading.load(tiny_weights_dir / "de-en").model
    src = source_batch(tiny_tokenizer, ["Ein Hund läuft über eine Wiese.", "Zwei Männer."])
    tgt = torch.tensor([[2, 10, 11, 12], [2, 13, 14, 15]])
    with torch.inference_mode():
        theirs = reloaded(input_ids=src, attention_mask=src.ne(0).long(), decoder_input_ids=tgt).logits
        torch.testing.assert_close(theirs, ours(src, tgt), atol=1e-4, rtol=0)
