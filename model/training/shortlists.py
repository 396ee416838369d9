"""Building a checkpoint's lexical shortlist (``model.engine.shortlist``) from its training data.

    python -m model.training.shortlists --weights weights/de-en [--per-source 200 --frequent 2000]

writes ``shortlist.safetensors`` into the checkpoint folder (``model.training.train`` does the
same for each run it finishes); ``model.engine.loading.load_shortlist`` reads it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from model.checkpoint import SPM, CheckpointError, model_config, read_meta
from model.engine import shortlist
from model.network.tokenizer import Tokenizer
from model.training.data import Parallel, read_parallel, split_file

log = logging.getLogger(__name__)


def write_shortlist(
    path: str | Path,
    data_dir: str | Path | None = None,
    per_source: int = shortlist.PER_SOURCE,
    frequent: int = shortlist.FREQUENT,
) -> Path:
    """Build a one-direction checkpoint's shortlist (``shortlist.build``) from the training split
    its config.json names (in ``data_dir``, default the folder named there, relative to the
    working directory) and write it into the folder. -> the file written."""
    path = Path(path)
    meta = read_meta(path)
    if meta.get("target_tags"):
        raise CheckpointError(f"{path}: a many-to-many model has no shortlist (one per direction would be needed)")
    data = meta.get("training", {}).get("config", {}).get("data", {})
    folder = Path(data_dir or data.get("dir", ""))
    source, target, split = meta["source_lang"], meta["target_lang"], data.get("train", "train")
    files = split_file(folder, split, source), split_file(folder, split, target)
    if not all(f.is_file() for f in files):
        raise CheckpointError(f"{files[0]}, {files[1]}: training data not found (pass its folder)")
    return write_shortlist_from(path, read_parallel(*files), split, per_source, frequent)


def write_shortlist_from(
    path: str | Path,
    pairs: Parallel,
    split: str,
    per_source: int = shortlist.PER_SOURCE,
    frequent: int = shortlist.FREQUENT,
) -> Path:
    """``write_shortlist`` from parallel text in memory (``split`` names it in the file's
    metadata): a run on streamed corpora builds it from its sample of training pairs."""
    path = Path(path)
    meta = read_meta(path)
    cfg, tokenizer = model_config(meta, path), Tokenizer.load(path / SPM)
    table = shortlist.build(
        zip(tokenizer.encode(pairs.src), tokenizer.encode(pairs.tgt), strict=True),
        tokenizer.vocab_size,
        specials=max(cfg.pad_id, cfg.unk_id, cfg.bos_id, cfg.eos_id) + 1,
        per_source=per_source,
        frequent=frequent,
    )
    out = path / shortlist.FILE
    info = {"per_source": str(per_source), "frequent": str(frequent), "pairs": str(len(pairs)), "split": split}
    store = torch.int16 if tokenizer.vocab_size <= torch.iinfo(torch.int16).max else torch.int32
    tensors = {"offsets": table.offsets, "targets": table.targets.to(store), "always": table.always.to(store)}
    save_file(tensors, str(out), metadata=info)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", required=True, type=Path, help="a one-direction checkpoint folder")
    parser.add_argument("--data-dir", type=Path, help="default: the folder its training config names")
    parser.add_argument("--per-source", type=int, default=shortlist.PER_SOURCE)
    parser.add_argument("--frequent", type=int, default=shortlist.FREQUENT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = write_shortlist(args.weights, args.data_dir, args.per_source, args.frequent)
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
