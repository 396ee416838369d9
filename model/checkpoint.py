"""Checkpoint folders: ``model.safetensors`` + ``config.json`` + ``spm.model`` (never pickle).

This module only reads and writes folders; ``model.engine.loading`` prepares a folder's network
for inference (kernels, precision). ``read`` validates everything it reads and raises
``CheckpointError`` with a message that names the file and the problem, instead of a traceback
from deep inside torch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from model.network.config import ModelConfig
from model.network.tokenizer import Tokenizer, TokenizerError
from model.network.transformer import Transformer
from model.network.vocabulary import VocabularyTokenizer

log = logging.getLogger(__name__)

WEIGHTS, CONFIG, SPM, METRICS = "model.safetensors", "config.json", "spm.model", "metrics.json"
# Weights above this size are written as shards (model-00001-of-00003.safetensors, ...): every
# file of a checkpoint stays under 16 MiB (what a file transfer of the GPU machine takes back).
SHARD_BYTES = 15 * 2**20
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing a file, or a file is corrupt or does not match."""


def unique_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors stored once (the first name wins)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        if tensor.is_meta:
            raise CheckpointError(
                f"{name}: released for inference (model.engine.kernels.release_float_weights); "
                "load the checkpoint with keep_float_weights=True to save it"
            )
        key = tensor.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().contiguous()
    return out


def save(
    path: str | Path,
    model: Transformer,
    tokenizer: Tokenizer,
    meta: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a checkpoint folder. ``meta`` goes into config.json beside the model config."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to("cpu", dtype if v.is_floating_point() else v.dtype) for k, v in unique_state(model).items()}
    for old in weight_files(path):
        old.unlink()
    shards = _shards(tensors)
    for i, shard in enumerate(shards, 1):
        name = WEIGHTS if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
    for name, data in tokenizer.files().items():
        (path / name).write_bytes(data)
    config = {
        **(meta or {}),
        "format_version": FORMAT_VERSION,
        "model": model.config.to_dict(),
        "tokenizer": tokenizer.describe(),
        "storage_dtype": str(dtype).removeprefix("torch."),
    }
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return path


def _shards(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, cut into groups of at most ``SHARD_BYTES`` (a larger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def weight_files(path: str | Path) -> list[Path]:
    """A checkpoint folder's weights: model.safetensors, or its shards in order."""
    path = Path(path)
    single = path / WEIGHTS
    return [single] if single.is_file() else sorted(path.glob("model-*-of-*.safetensors"))


def directions(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """The (source, target) pairs a checkpoint translates: its one direction, or a
    many-to-many model's list (each source led by its target's tag, ``target_tag``)."""
    if "directions" in meta:
        return [(source, target) for source, target in (d.split("-", 1) for d in meta["directions"])]
    return [(str(meta["source_lang"]), str(meta["target_lang"]))]


def read_meta(path: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint folder, validated to hold a model config."""
    file = Path(path) / CONFIG
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (is {path} a checkpoint folder?)")
    try:
        meta = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file}: not valid JSON ({err})") from err
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise CheckpointError(f"{file}: no 'model' section")
    return meta


def recommended_decoding(meta: dict[str, Any], direction: str | None = None) -> dict[str, Any]:
    """The model card's recommended decoding (config.json "decoding") for one direction: a
    many-to-many card's ``length_penalty_by_direction`` and ``no_repeat_ngram_size_by_direction``
    entries, where it has one, replace the length penalty and the n-gram size."""
    card = dict(meta.get("decoding", {}))
    for key, kind in (("length_penalty", float), ("no_repeat_ngram_size", int)):
        by_direction = card.pop(f"{key}_by_direction", None) or {}
        if direction in by_direction:
            card[key] = kind(by_direction[direction])
    return card


def model_config(meta: dict[str, Any], where: Path) -> ModelConfig:
    try:
        return ModelConfig.from_dict(meta["model"])
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where / CONFIG}: {err}") from err


@dataclass(frozen=True)
class Folder:
    """A checkpoint folder read into memory: the network as built (float32, CPU), its weights
    loaded; its tokenizer; config.json's content."""

    model: Transformer
    tokenizer: Tokenizer
    meta: dict[str, Any]
    path: Path


def read(path: str | Path) -> Folder:
    """Read and validate a checkpoint folder; ``CheckpointError`` names the file and the problem."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint folder not found")
    meta = read_meta(path)
    config = model_config(meta, path)
    tokenizer = load_tokenizer(path, meta)
    if tokenizer.vocab_size != config.tgt_vocab_size:
        raise CheckpointError(
            f"{path}: vocabulary of {tokenizer.vocab_size} pieces, but {CONFIG} says {config.tgt_vocab_size}"
        )
    source = getattr(tokenizer, "source_vocab_size", tokenizer.vocab_size)
    if source != config.src_vocab_size:
        raise CheckpointError(
            f"{path}: source vocabulary of {source} pieces, but {CONFIG} says {config.src_vocab_size}"
        )
    model = Transformer(config)
    load_weights(model, path)
    return Folder(model, tokenizer, meta, path)


def load_tokenizer(path: Path, meta: dict[str, Any]) -> Tokenizer:
    """The folder's tokenizer as config.json's "tokenizer" section describes it: one sentencepiece
    model whose ids are the model's (``spm.model``, the default), or sentencepiece models with a
    vocabulary of their own (``model.network.vocabulary``: imported models)."""
    section = meta.get("tokenizer") or {}
    if section.get("type", "sentencepiece") == "sentencepiece":
        try:
            return Tokenizer.load(path / SPM)
        except TokenizerError as err:
            raise CheckpointError(f"{path / SPM}: {err}") from err
    try:
        if section["type"] == "vocabulary":
            files = [path / section[key] for key in ("source_spm", "target_spm", "vocabulary")]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise TokenizerError(f"missing {', '.join(missing)}")
            return VocabularyTokenizer.from_files(*(f.read_bytes() for f in files))
        raise TokenizerError(f"unknown tokenizer type {section['type']!r}")
    except (TokenizerError, KeyError) as err:
        raise CheckpointError(f"{path / CONFIG} (tokenizer): {err}") from err


def load_metadata(file: Path) -> dict[str, str]:
    """A safetensors file's metadata (its header's ``__metadata__``)."""
    with safe_open(str(file), framework="pt") as f:
        return dict(f.metadata() or {})


def load_weights(model: Transformer, path: Path) -> None:
    """Copy tensors from a checkpoint folder's safetensors file (or shards) into ``model`` after
    checking names and shapes."""
    files = weight_files(path)
    if not files:
        raise CheckpointError(f"{path / WEIGHTS}: missing")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{file}: corrupt or not a safetensors file ({err})") from err
    assign(model, tensors, str(files[0] if len(files) == 1 else path))


def assign(model: Transformer, tensors: dict[str, torch.Tensor], where: str = "state") -> None:
    """Copy a (tie-deduplicated) state into ``model``; names and shapes must match exactly."""
    expected = unique_state(model)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: tensors do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    wrong = [
        f"{k} {tuple(tensors[k].shape)} != {tuple(v.shape)}" for k, v in expected.items() if tensors[k].shape != v.shape
    ]
    if wrong:
        raise CheckpointError(f"{where}: tensor shapes do not match the config: {wrong[:5]}")
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(tensors[name])
