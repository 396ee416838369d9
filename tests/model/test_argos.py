"""Imported Argos Translate packages decode as CTranslate2 decodes them, to the token.

Packages are built the way Argos builds them: a model converted by CTranslate2's own converters
(``OpenNMTPyConverter`` on an OpenNMT-py checkpoint: ``tests.factories.opennmt_argos_package``;
the shipped de-en model through ``ctranslate2.converters.Converter``:
``bench.ctranslate2_convert.CheckpointConverter``), zipped with ``metadata.json`` and the
sentencepiece model. CTranslate2 is asked for what the engine does: ``min_decoding_length=0``
(its default, 1, forbids EOS at the first step; the engine lets a sentence end there).
"""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from model import checkpoint
from model.engine import loading
from model.engine.options import DecodingOptions
from model.engine.translator import Translator
from model.imports import main as import_main
from model.training.data import read_lines
from tests.factories import opennmt_argos_package
from tests.helpers import require

LIMIT = 10


@pytest.fixture(scope="module")
def ct2() -> Any:
    require(importlib.util.find_spec("ctranslate2") is not None, "ctranslate2 is not installed (dev extra)")
    import ctranslate2

    return ctranslate2


@pytest.fixture(scope="module")
def package(ct2: Any, tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("argos")
    return opennmt_argos_package(folder / "translate-de_en-1_0.argosmodel", read_lines(data_dir / "train.de.gz")[:3000])


def unpacked(package: Path, where: Path) -> Path:
    with zipfile.ZipFile(package) as archive:
        archive.extractall(where)
    return next(where.iterdir())


def ct2_greedy(ct2: Any, package_dir: Path, sentences: list[str]) -> list[tuple[str, ...]]:
    """CTranslate2's greedy pieces for ``sentences``, tokenized as Argos tokenizes them."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(package_dir / "sentencepiece.model"))
    translator = ct2.Translator(str(package_dir / "model"))
    results = translator.translate_batch(
        [sp.encode(s, out_type=str) for s in sentences], beam_size=1, max_decoding_length=LIMIT, min_decoding_length=0
    )
    return [tuple(r.hypotheses[0]) for r in results]


def our_greedy(folder: Path, sentences: list[str], fused: bool = True) -> list[tuple[str, ...]]:
    ckpt = loading.load(folder, fused=fused)
    options = DecodingOptions(beam_size=1, max_length_a=0.0, max_length_b=LIMIT)
    hyps = Translator(ckpt.model, ckpt.tokenizer).decode_ids(ckpt.tokenizer.encode(sentences), options)
    return [tuple(ckpt.tokenizer.pieces(h[0].ids)) for h in hyps]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "tensor-ops"])
def test_opennmt_package_greedy_is_ctranslate2s(
    ct2: Any, package: Path, tmp_path: Path, data_dir: Path, fused: bool, fused_kernels: None
) -> None:
    out = tmp_path / "weights" / "de-en"
    import_main([str(package), "--out", str(out)])
    meta = json.loads((out / "config.json").read_text())
    assert meta["model"]["norm_first"] and not meta["model"]["source_eos"]  # OpenNMT-py: pre-LN, no source EOS
    assert "Argos Translate package" in (out / "README.md").read_text()
    sentences = read_lines(data_dir / "val.de.gz")[:200]
    theirs = ct2_greedy(ct2, unpacked(package, tmp_path / "unpacked"), sentences)
    ours = our_greedy(out, sentences, fused)
    assert len(set(ours)) > 50 and sum(len(row) < LIMIT for row in ours) > 20  # varied, some end early
    assert ours == theirs


def test_an_unpacked_package_imports_the_same(package: Path, tmp_path: Path) -> None:
    import_main([str(package), "--out", str(tmp_path / "zip" / "de-en")])
    import_main([str(unpacked(package, tmp_path / "unpacked")), "--out", str(tmp_path / "folder" / "de-en")])
    a, b = (checkpoint.read(tmp_path / k / "de-en").model for k in ("zip", "folder"))
    for (name, x), y in zip(checkpoint.unique_state(a).items(), checkpoint.unique_state(b).values(), strict=True):
        assert torch.equal(x, y), name


def shipped_package(shipped: Path, where: Path) -> Path:
    """The shipped de-en as an Argos package: CTranslate2's Converter over its spec, zipped."""
    from bench.ctranslate2_convert import CheckpointConverter

    root = where / "translate-de_en-shipped"
    root.mkdir(parents=True)
    CheckpointConverter(shipped).convert(str(root / "model"))
    (root / "sentencepiece.model").write_bytes((shipped / "spm.model").read_bytes())
    (root / "metadata.json").write_text(json.dumps({"from_code": "de", "to_code": "en", "package_version": "1.0"}))
    package = where / "shipped.argosmodel"
    with zipfile.ZipFile(package, "w") as archive:
        for file in sorted(root.rglob("*")):
            archive.write(file, file.relative_to(where))
    return package


def test_a_shipped_model_comes_back_with_identical_weights(
    ct2: Any, shipped: Path, tmp_path: Path, data_dir: Path
) -> None:
    package = shipped_package(shipped, tmp_path / "package")
    out = tmp_path / "weights" / "de-en"
    import_main([str(package), "--out", str(out)])
    original, imported = checkpoint.read(shipped).model, checkpoint.read(out).model
    theirs = checkpoint.unique_state(imported)
    for name, tensor in checkpoint.unique_state(original).items():
        assert torch.equal(theirs[name], tensor), name
    for embed in ("src_embed", "tgt_embed"):  # the sinusoidal table comes back as a stored one
        assert original.src_embed.table is not None
        assert torch.equal(theirs[f"{embed}.learned.weight"], original.src_embed.table)
    same = {"positions": "sinusoidal", "layer_norm_eps": original.config.layer_norm_eps}
    no_dropout = {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}
    assert imported.config.to_dict() | same == original.config.to_dict() | no_dropout
    sentences = read_lines(data_dir / "val.de.gz")[:40]
    assert our_greedy(out, sentences) == ct2_greedy(ct2, unpacked(package, tmp_path / "unpacked"), sentences)
