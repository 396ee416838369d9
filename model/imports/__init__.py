"""Import the models people already have into this engine's checkpoint folders: OPUS-MT
(Hugging Face ``MarianMTModel`` folders, ``model.imports.marian``) and Argos Translate packages
(``.argosmodel``: a CTranslate2 model, ``model.imports.argos``). Each becomes the project's own
folder (``model.checkpoint``) with a model card saying where it came from, and the service serves
it like a shipped one. What the network lacks is a ``ModelConfig`` option; what no option
expresses is refused with ``UnsupportedModel``, naming it: never an approximation.

    translator import PATH --out weights/en-de [--source en --target de]
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model import checkpoint
from model.network.config import ModelConfig
from model.network.tokenizer import Tokenizer
from model.network.transformer import Transformer

log = logging.getLogger(__name__)


class UnsupportedModel(ValueError):
    """A model this engine cannot run exactly; the message names what."""


@dataclass(frozen=True)
class Imported:
    """A foreign model read into our terms: the network's config and its tensors by our names
    (tied tensors once), the tokenizer, config.json's extra sections and the model card's lines
    about where it came from."""

    config: ModelConfig
    state: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    meta: dict[str, Any]
    origin: list[str] = field(default_factory=list)

    def model(self) -> Transformer:
        """The network with these weights (float32, CPU)."""
        model = Transformer(self.config)
        try:
            checkpoint.assign(model, self.state, "imported model")
        except checkpoint.CheckpointError as err:
            raise UnsupportedModel(str(err)) from err
        return model.eval()


CARD = """# {name}: imported {kind}

**Not trained here.** This folder was written by `translator import` from {kind}; its weights
are those of the original, computed by this engine exactly (the import refuses what it cannot
run exactly). Its quality is the original's: see the original model card.

- Source: `{source}`
- Direction: {direction}
{origin}

## The network

{network}

## Decoding

The model card's recommended decoding (config.json `decoding`): {decoding}.
"""


def model_card(imported: Imported, name: str, kind: str, source: str) -> str:
    cfg = imported.config
    network = (
        f"{cfg.encoder_layers}+{cfg.decoder_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads, "
        f"d_ff {cfg.d_ff}, {'pre' if cfg.norm_first else 'post'}-LN, {cfg.activation} activation, "
        f"{'scaled' if cfg.scale_embeddings else 'unscaled'} embeddings, positions {cfg.positions}, "
        f"vocabulary {cfg.src_vocab_size} source / {cfg.tgt_vocab_size} target pieces "
        f"({'shared' if cfg.share_embeddings else 'separate'} embeddings), "
        f"{'an' if cfg.output_bias else 'no'} output bias, {'EOS' if cfg.source_eos else 'nothing'} after each source."
    )
    meta = imported.meta
    return CARD.format(
        name=name,
        kind=kind,
        source=source,
        direction=f"{meta['source_lang']} → {meta['target_lang']}",
        origin="\n".join(f"- {line}" for line in imported.origin),
        network=network,
        decoding=", ".join(f"{k} {v}" for k, v in meta.get("decoding", {}).items()) or "the engine's defaults",
    )


def write(imported: Imported, out: str | Path, kind: str, source: str | Path) -> Path:
    """Save ``imported`` as a checkpoint folder ``out`` with its model card (README.md)."""
    out = Path(out)
    model = imported.model()
    checkpoint.save(out, model, imported.tokenizer, imported.meta)
    (out / "README.md").write_text(model_card(imported, out.name, kind, str(source)))
    log.info("imported %s from %s into %s (%d parameters)", kind, source, out, model.num_parameters())
    return out


def languages(out: Path, source: str | None, target: str | None, found: tuple[str, str] | None) -> tuple[str, str]:
    """The direction: as given, else as the model says (``found``), else the out folder's name
    ``xx-yy``; UnsupportedModel where none says."""
    if source and target:
        return source, target
    if found is not None:
        return found
    match = re.fullmatch(r"([a-z]{2,3})-([a-z]{2,3})", out.name)
    if match is None:
        raise UnsupportedModel(f"no languages: name the folder xx-yy ({out.name}) or pass --source and --target")
    return match.group(1), match.group(2)


def read(path: str | Path, out: Path, source: str | None = None, target: str | None = None) -> tuple[Imported, str]:
    """Read ``path`` (a Marian folder, an ``.argosmodel`` or its unpacked folder) -> the model and
    what kind it was."""
    from model.imports import argos, marian

    path = Path(path)
    if marian.is_marian(path):
        return marian.read(path, out, source, target), "an OPUS-MT (Marian) model"
    if argos.is_argos(path):
        return argos.read(path, out, source, target), "an Argos Translate package"
    raise UnsupportedModel(
        f"{path}: neither a Marian folder (config.json with model_type 'marian') nor an Argos Translate "
        "package (.argosmodel, or a folder with metadata.json and a CTranslate2 model)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="translator import",
        description="Import an OPUS-MT (Marian) folder or an Argos Translate package as a checkpoint folder.",
    )
    parser.add_argument("path", type=Path, help="a save_pretrained MarianMTModel folder, an .argosmodel, or its folder")
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint folder to write (weights/xx-yy)")
    parser.add_argument("--source", help="source language code (default: the model's, or the folder name's)")
    parser.add_argument("--target", help="target language code (default: the model's, or the folder name's)")
    args = parser.parse_args(argv)
    try:
        imported, kind = read(args.path, args.out, args.source, args.target)
        write(imported, args.out, kind, args.path)
    except (UnsupportedModel, checkpoint.CheckpointError, OSError) as err:
        raise SystemExit(f"translator import: {err}") from None
    print(f"wrote {args.out}: {kind}, {imported.meta['source_lang']}-{imported.meta['target_lang']}")
