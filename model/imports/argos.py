"""Argos Translate packages (what LibreTranslate serves): an ``.argosmodel`` zip, or the folder it
unpacks to, holding ``metadata.json`` (``from_code``, ``to_code``), a CTranslate2 model folder
(``model/``) and ``sentencepiece.model``. Argos cuts text with the sentencepiece model, looks the
pieces up in the CTranslate2 model's vocabulary and decodes with CTranslate2; the import does the
same with ``model.network.vocabulary`` and the network ``model.imports.ct2_model`` reads."""

from __future__ import annotations

import json
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from model.imports import Imported, UnsupportedModel, languages
from model.imports.ct2_model import START, network
from model.network.vocabulary import VocabularyTokenizer

SPM = "sentencepiece.model"


def _root(folder: Path) -> Path | None:
    """The package folder: ``folder`` itself or its one subfolder holding metadata.json."""
    if (folder / "metadata.json").is_file():
        return folder
    inner = [p for p in folder.iterdir() if p.is_dir() and (p / "metadata.json").is_file()] if folder.is_dir() else []
    return inner[0] if len(inner) == 1 else None


def is_argos(path: Path) -> bool:
    if path.is_file():
        return zipfile.is_zipfile(path) and any(n.endswith("metadata.json") for n in zipfile.ZipFile(path).namelist())
    return path.is_dir() and _root(path) is not None


def read(path: Path, out: Path, source: str | None = None, target: str | None = None) -> Imported:
    if path.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            with zipfile.ZipFile(path) as archive:
                for member in archive.namelist():  # (no member may leave the folder)
                    if Path(member).is_absolute() or ".." in Path(member).parts:
                        raise UnsupportedModel(f"{path}: unsafe member {member!r}")
                archive.extractall(tmp)
            return _read_folder(Path(tmp), path, out, source, target)
    return _read_folder(path, path, out, source, target)


def _read_folder(folder: Path, origin: Path, out: Path, source: str | None, target: str | None) -> Imported:
    root = _root(folder)
    if root is None:
        raise UnsupportedModel(f"{origin}: no metadata.json")
    metadata: dict[str, Any] = json.loads((root / "metadata.json").read_text())
    model_dir = root / "model"
    if not (model_dir / "model.bin").is_file():
        raise UnsupportedModel(f"{origin}: no CTranslate2 model (model/model.bin)")
    if not (root / SPM).is_file():
        raise UnsupportedModel(f"{origin}: no {SPM}")
    net = network(model_dir)
    proto = (root / SPM).read_bytes()
    ct2 = net.ct2_config
    specials = [ct2.get("eos_token", "</s>"), ct2.get("bos_token", "<s>"), "<blank>", "<pad>", START]
    joint = net.source_vocab == net.target_vocab
    tokenizer = VocabularyTokenizer(
        proto, proto, net.source_vocab, None if joint else net.target_vocab, ct2.get("unk_token", "<unk>"), specials
    )
    found = (metadata["from_code"], metadata["to_code"]) if "from_code" in metadata and "to_code" in metadata else None
    src, tgt = languages(out, source, target, found)
    meta = {
        "source_lang": src,
        "target_lang": tgt,
        "decoding": {"beam_size": 4},
        "imported": {"format": "argos", "from": str(origin), "metadata": metadata, "ctranslate2_config": ct2},
    }
    lines = [
        f"Format: Argos Translate package {metadata.get('package_version', '')} "
        f"({metadata.get('name', origin.name)}), a CTranslate2 model",
        "Weights stored as integers (int8) are dequantized to float32 (q / scale): the model's own numbers",
    ]
    return Imported(net.config, net.state, tokenizer, meta, lines)
