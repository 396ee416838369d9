"""Parallel text: reading, cleaning, and length-bucketed batches bounded by tokens."""

from __future__ import annotations

import gzip
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

import torch

from model.engine.batches import pad, token_batches

# Multi30k task 1 (``{split}.{lang}.gz``): by default the workplace's shared copy beside this
# repository (never committed into it), or the folder the environment's MULTI30K_DIR names (a
# machine without that copy: a lent GPU, docs/gpu.md). Every command's --data-dir and the tests default here.
SHARED_MULTI30K = Path(__file__).resolve().parents[3] / "shared" / "data" / "multi30k"
MULTI30K_DIR = Path(os.environ.get("MULTI30K_DIR") or SHARED_MULTI30K)

log = logging.getLogger(__name__)


def _opener(path: Path) -> Callable[..., IO[str]]:
    return cast(Callable[..., IO[str]], gzip.open if path.suffix == ".gz" else open)


def read_lines(path: str | Path) -> list[str]:
    """All lines of a UTF-8 text file, plain or gzip, without trailing newlines."""
    path = Path(path)
    with _opener(path)(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\r\n") for line in f]


def write_lines(path: Path, lines: Sequence[str]) -> None:
    """``read_lines``' inverse: one line each, UTF-8, gzip when the name ends in .gz; written
    whole or not at all. A line holding a newline is refused (it would break line pairing)."""
    if any("\n" in line for line in lines):
        raise ValueError("a line holds a newline: it would break the line pairing")
    tmp = path.with_name(path.name + ".tmp")
    with _opener(path)(tmp, "wt", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
    tmp.replace(path)


def split_file(data_dir: str | Path, split: str, lang: str) -> Path:
    """The file of one split and language, preferring the gzip one."""
    base = Path(data_dir) / f"{split}.{lang}"
    gz = base.with_name(base.name + ".gz")
    return gz if gz.exists() else base


@dataclass(frozen=True)
class Parallel:
    """Aligned source and target sentences."""

    src: list[str]
    tgt: list[str]

    def __len__(self) -> int:
        return len(self.src)

    def head(self, n: int) -> Parallel:
        """The first n pairs (all when n <= 0)."""
        return self if n <= 0 else Parallel(self.src[:n], self.tgt[:n])


def concat(parts: Iterable[Parallel]) -> Parallel:
    """The pairs of every part, in order."""
    parts = list(parts)
    return Parallel([x for t in parts for x in t.src], [y for t in parts for y in t.tgt])


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> Parallel:
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise ValueError(f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}")
    return Parallel(src, tgt)


MAX_CHARS = 1000


def drop_reason(s: str, t: str, max_ratio: float = 3.0, max_chars: int = MAX_CHARS) -> str | None:
    """Why cleaning drops a stripped pair: "empty" (a side is), "too_long" (a side over
    ``max_chars`` characters), "ratio" (one side over ``max_ratio`` times the other's length, the
    longer over 20 characters); None to keep it. The one rule of ``clean`` and the streamed corpora."""
    if not s or not t:
        return "empty"
    if len(s) > max_chars or len(t) > max_chars:
        return "too_long"
    if max(len(s), len(t)) / min(len(s), len(t)) > max_ratio and max(len(s), len(t)) > 20:
        return "ratio"
    return None


def clean(data: Parallel, max_ratio: float = 3.0, max_chars: int = MAX_CHARS) -> Parallel:
    """Strip whitespace; drop empty pairs, overlong lines and absurd length ratios (``drop_reason``)."""
    src, tgt = [], []
    dropped: dict[str, int] = {}
    for s, t in zip(data.src, data.tgt, strict=True):
        s, t = s.strip(), t.strip()
        reason = drop_reason(s, t, max_ratio, max_chars)
        if reason is not None:
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        src.append(s)
        tgt.append(t)
    if dropped:
        log.info("cleaning dropped %d of %d pairs: %s", len(data) - len(src), len(data), dropped)
    return Parallel(src, tgt)


@dataclass(frozen=True)
class Batch:
    """src: (B, S) ids ending in EOS; tgt_in: (B, T) BOS + target; tgt_out: (B, T) target + EOS."""

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor

    @property
    def target_tokens(self) -> int:
        return int((self.tgt_out != 0).sum())


def make_batch(
    src: Sequence[Sequence[int]], tgt: Sequence[Sequence[int]], pad_id: int, bos_id: int, eos_id: int
) -> Batch:
    """Id lists (without specials) -> a padded training batch."""
    return Batch(
        src=pad([[*list(s), eos_id] for s in src], pad_id),
        tgt_in=pad([[bos_id, *t] for t in tgt], pad_id),
        tgt_out=pad([[*t, eos_id] for t in tgt], pad_id),
    )


class TokenizedCorpus:
    """Parallel ids in memory, served as token-bounded batches."""

    def __init__(self, src_ids: list[list[int]], tgt_ids: list[list[int]], pad_id: int, bos_id: int, eos_id: int):
        if len(src_ids) != len(tgt_ids):
            raise ValueError("source and target differ in length")
        self.src_ids, self.tgt_ids = src_ids, tgt_ids
        self.specials = (pad_id, bos_id, eos_id)

    def __len__(self) -> int:
        return len(self.src_ids)

    def batches(self, max_tokens: int, shuffle: bool, seed: int = 0) -> Iterator[Batch]:
        lengths = [max(len(s), len(t)) + 1 for s, t in zip(self.src_ids, self.tgt_ids, strict=True)]
        for idx in token_batches(lengths, max_tokens, shuffle, seed):
            yield make_batch([self.src_ids[i] for i in idx], [self.tgt_ids[i] for i in idx], *self.specials)
