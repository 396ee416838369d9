"""The user's corpora (``[[data.corpora]]``), streamed from disk: memory stays flat whatever their size.

Each epoch every training corpus is read anew, line by line, and each pair goes through:

1. parsing (two aligned files, a TSV row or a JSONL object; a row without both sides is
   "malformed") and cleaning (``data.drop_reason``: empty, too long, length ratio);
2. sharding: a pair belongs to one process, chosen by a hash of its text (``Pair.shard``), so
   each process of a ``torchrun`` run trains on its own part, identical pairs land on the same
   process, and the parts together are exactly what one process trains on;
3. de-duplication within its corpus, in fixed memory (``Seen``, a Bloom filter of
   ``[data] dedup_mb``: exact in practice up to tens of millions of pairs per process, beyond which a
   rare unique pair is taken for a duplicate);
4. weighting: a corpus of weight 2 is read twice an epoch, one of weight 0.1 keeps a tenth of its
   pairs, drawn anew each epoch by a hash of the pair and the epoch;
5. mixing: the corpora interleaved at random in proportion to what each has left, then a
   shuffle buffer of ``[data] shuffle_buffer`` pairs;
6. batching as the in-memory corpus does: ``[data] bucket`` pairs at a time are tokenized, sorted
   by length and cut into batches of at most ``max_tokens`` padded tokens, in shuffled order.

Everything random is seeded by the run's seed, the epoch and the process, so a resumed run
reads what an unbroken one read. ``scan`` reads the corpora once before training: what cleaning
dropped, per corpus and reason (the run's ``data.json``), how many pairs each process holds, and
the sample of training pairs the tokenizer and the shortlist learn from (the pairs of smallest
hash: the same sample whatever the number of processes). Validation and test corpora are small
and read whole (``read_corpus``).
"""

from __future__ import annotations

import gzip
import hashlib
import heapq
import itertools
import json
import logging
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from model.engine.batches import token_batches
from model.training.config import CorpusConfig, DataConfig
from model.training.data import Batch, Parallel, drop_reason, make_batch

log = logging.getLogger(__name__)

Encode = Callable[[list[str], int], list[list[int]]]  # (texts, seed) -> ids; the seed for sampled segmentations
REASONS = ("malformed", "empty", "too_long", "ratio", "duplicate")
MASK64 = (1 << 64) - 1


def open_text(path: Path) -> IO[str]:
    """A UTF-8 text file, plain or gzip, read line by line; only "\\n" ends a line (a stray "\\r"
    inside a line must not break the pairing of aligned files), undecodable bytes become U+FFFD."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace", newline="\n")
    return open(path, encoding="utf-8", errors="replace", newline="\n")


def _field(obj: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def raw_pairs(corpus: CorpusConfig, data: DataConfig) -> Iterator[tuple[str, str] | None]:
    """Each line's or row's (source, target), unstripped; None for a row without both sides
    (too few TSV columns, JSONL that is not an object with both keys as strings, bytes that are
    not UTF-8). Aligned files of different lengths raise ``ValueError``."""
    if corpus.kind == "pair":
        src_path, tgt_path = (data.path(f) for f in corpus.files)
        with open_text(src_path) as a, open_text(tgt_path) as b:
            for number, (s, t) in enumerate(itertools.zip_longest(a, b), 1):
                if s is None or t is None:
                    raise ValueError(f"{src_path} and {tgt_path} differ in length (line {number})")
                s, t = s.rstrip("\r\n"), t.rstrip("\r\n")
                yield None if "\ufffd" in s or "\ufffd" in t else (s, t)
        return
    path = data.path(corpus.file)
    with open_text(path) as f:
        if corpus.kind == "tsv":
            columns = corpus.columns or (0, 1)
            named = any(isinstance(c, str) for c in columns)
            header = next(f, "").rstrip("\r\n").split("\t") if corpus.header or named else []
            try:
                i, j = (header.index(c) if isinstance(c, str) else int(c) for c in columns)
            except ValueError:
                raise ValueError(f"{path}: columns {list(columns)} not in its header {header}") from None
            for line in f:
                parts = line.rstrip("\r\n").split("\t")
                ok = len(parts) > max(i, j) and "\ufffd" not in parts[i] and "\ufffd" not in parts[j]
                yield (parts[i], parts[j]) if ok else None
        else:
            keys = [str(c) for c in corpus.columns] or [data.source, data.target]
            for line in f:
                try:
                    obj = json.loads(line)
                except ValueError:
                    yield None
                    continue
                s, t = _field(obj, keys[0]), _field(obj, keys[1])
                ok = isinstance(s, str) and isinstance(t, str) and "\ufffd" not in s + t
                yield (s, t) if ok else None


def read_corpus(corpus: CorpusConfig, data: DataConfig) -> Parallel:
    """A validation or test corpus, whole: every row with both sides, stripped (not cleaned, so
    scores stay comparable with other systems'), in file order."""
    src, tgt = [], []
    for pair in raw_pairs(corpus, data):
        if pair is not None:
            src.append(pair[0].strip())
            tgt.append(pair[1].strip())
    return Parallel(src, tgt)


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit integer from any integer."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class Pair:
    """A cleaned pair and the 64-bit hashes of its text (blake2b, so the same in every process)."""

    src: str
    tgt: str
    probe: int  # the duplicate filter's
    step: int  # the duplicate filter's (odd)
    shard: int  # -> its process
    rank: int  # the sample's order, and each epoch's draws for a fractional weight

    @classmethod
    def of(cls, src: str, tgt: str) -> Pair:
        digest = hashlib.blake2b(f"{src}\t{tgt}".encode(), digest_size=32).digest()
        h = [int.from_bytes(digest[i : i + 8], "little") for i in range(0, 32, 8)]
        return cls(src, tgt, h[0], h[1] | 1, h[2], h[3])

    def draw(self, salt: int) -> float:
        """A number in [0, 1) fixed by the pair and ``salt`` (the epoch and pass)."""
        return _mix(self.rank ^ _mix(salt)) / 2**64


class Seen:
    """The pairs seen so far, approximately, in fixed memory: a Bloom filter of ``size`` bytes
    with four probes (1 in 4 million of new pairs taken for seen ones at 3 million pairs per 64
    MiB, 1 in 100 at 50 million). ``salt`` keeps corpora and passes apart in one filter."""

    PROBES = 4

    def __init__(self, size: int) -> None:
        self.bits = bytearray(size)
        self.size = len(self.bits) * 8

    @classmethod
    def for_corpora(cls, data: DataConfig) -> Seen:
        """A filter of ``[data] dedup_mb`` at most, smaller for smaller training corpora: a byte for
        every 8 bytes of text (a gzip file's counted 4 times), at least 64 KiB; none at 0."""
        if not data.dedup_mb:
            return cls(0)
        text = 0
        for corpus in data.corpora_of("train"):
            for name in corpus.files or (corpus.file,):
                path = data.path(name)
                text += path.stat().st_size * (4 if path.suffix == ".gz" else 1) if path.exists() else 0
        return cls(min(data.dedup_mb * 2**20, max(2**16, text // 8)))

    def add(self, pair: Pair, salt: int) -> bool:
        """Record the pair; -> whether it was (probably) recorded before."""
        if not self.size:
            return False
        bits, size, start = self.bits, self.size, pair.probe ^ salt
        new = False
        for i in range(1, self.PROBES + 1):
            at = (start + i * pair.step) % size
            byte, bit = at >> 3, 1 << (at & 7)
            if not bits[byte] & bit:
                bits[byte] |= bit
                new = True
        return not new


@dataclass
class Counts:
    """One corpus's pairs in one process's shard: read (all rows, whichever shard), kept, and
    dropped per reason (``REASONS``)."""

    read: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))

    def merged(self, other: Counts) -> Counts:
        dropped = {k: self.dropped.get(k, 0) + other.dropped.get(k, 0) for k in REASONS}
        return Counts(max(self.read, other.read), self.kept + other.kept, dropped)

    def as_dict(self) -> dict[str, Any]:
        return {"read": self.read, "kept": self.kept, "dropped": dict(self.dropped)}


def _salt(corpus: int, copy: int) -> int:
    return _mix(corpus * 1_000_003 + copy)


def kept_pairs(
    data: DataConfig,
    index: int,
    corpus: CorpusConfig,
    rank: int,
    world: int,
    seen: Seen,
    copy: int = 0,
    counts: Counts | None = None,
) -> Iterator[Pair]:
    """The pairs of ``corpus`` (the ``index``-th of [data] corpora) in process ``rank``'s shard
    that cleaning and de-duplication keep, in file order; ``copy`` numbers a weighted corpus's
    reads in one epoch (each de-duplicated on its own). ``counts`` (when given) counts them."""
    salt = _salt(index, copy)
    dropped = counts.dropped if counts is not None else dict.fromkeys(REASONS, 0)
    for raw in raw_pairs(corpus, data):
        if counts is not None:
            counts.read += 1
        if raw is None:
            dropped["malformed"] += rank == 0  # rows without a shard: process 0 counts them
            continue
        s, t = raw[0].strip(), raw[1].strip()
        reason = drop_reason(s, t, data.max_ratio)
        if reason is not None:
            dropped[reason] += rank == 0
            continue
        pair = Pair.of(s, t)
        if pair.shard % world != rank:
            continue
        if seen.add(pair, salt):
            dropped["duplicate"] += 1
            continue
        if counts is not None:
            counts.kept += 1
        yield pair


@dataclass
class Scan:
    """What one read of the training corpora found in one process's shard: per corpus (by
    position in [data] corpora), its ``Counts``; and the sample, the ``[data] sample_pairs``
    pairs of smallest ``Pair.rank``, in that order."""

    counts: dict[int, Counts]
    sample: list[Pair]


def scan(data: DataConfig, rank: int = 0, world: int = 1) -> Scan:
    seen = Seen.for_corpora(data)
    counts: dict[int, Counts] = {}
    heap: list[tuple[int, int, Pair]] = []  # (-rank, tie, pair): the largest of the smallest on top
    tie = itertools.count()
    for index, corpus in enumerate(data.corpora):
        if corpus.split != "train":
            continue
        counts[index] = Counts()
        for pair in kept_pairs(data, index, corpus, rank, world, seen, counts=counts[index]):
            item = (-pair.rank, next(tie), pair)
            if len(heap) < data.sample_pairs:
                heapq.heappush(heap, item)
            elif item > heap[0]:
                heapq.heapreplace(heap, item)
    return Scan(counts, sorted((p for _, _, p in heap), key=lambda p: (p.rank, p.src, p.tgt)))


def merge_scans(scans: Iterable[Scan], sample_pairs: int) -> Scan:
    """Every process's scan as one: the counts summed, the sample the smallest of all samples
    (the whole corpus's sample, since each process's holds its shard's smallest)."""
    scans = list(scans)
    counts: dict[int, Counts] = {}
    for one in scans:
        for index, c in one.counts.items():
            counts[index] = counts[index].merged(c) if index in counts else c
    every = (p for one in scans for p in one.sample)
    sample = heapq.nsmallest(sample_pairs, every, key=lambda p: (p.rank, p.src, p.tgt))
    return Scan(counts, sample)


def shuffled(items: Iterable[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """``items`` in random order, holding at most ``size`` of them: each new item takes the place
    of a random one held, which is given out."""
    held: list[Any] = []
    for item in items:
        if len(held) < size:
            held.append(item)
            continue
        at = rng.randrange(size)
        yield held[at]
        held[at] = item
    rng.shuffle(held)
    yield from held


class StreamedCorpus:
    """One process's training batches from the training corpora, epoch by epoch (the module's
    steps). ``kept`` is what ``scan`` counted in this process's shard, per corpus: the mixing's
    proportions."""

    def __init__(self, data: DataConfig, seed: int, kept: dict[int, int], rank: int = 0, world: int = 1) -> None:
        self.data, self.seed, self.rank, self.world = data, seed, rank, world
        self.kept = kept
        self.too_long = 0  # pairs over the model's length, dropped at tokenization (last epoch)

    def _rng(self, purpose: str, epoch: int) -> random.Random:
        return random.Random(f"{self.seed}/{purpose}/{epoch}/{self.rank}/{self.world}")

    def _weighted(self, index: int, corpus: CorpusConfig, epoch: int, seen: Seen) -> Iterator[tuple[str, str]]:
        whole, part = divmod(corpus.weight, 1.0)
        for copy in range(int(whole) + (part > 0)):
            salt = epoch * 1_000_003 + copy
            for pair in kept_pairs(self.data, index, corpus, self.rank, self.world, seen, copy):
                if copy < whole or pair.draw(salt) < part:
                    yield pair.src, pair.tgt

    def pairs(self, epoch: int) -> Iterator[tuple[str, str]]:
        """This epoch's training pairs of this process, mixed and shuffled (before batching)."""
        seen = Seen.for_corpora(self.data)
        streams, left = [], []
        for index, corpus in enumerate(self.data.corpora):
            if corpus.split == "train":
                streams.append(self._weighted(index, corpus, epoch, seen))
                left.append(self.kept.get(index, 0) * corpus.weight)
        rng = self._rng("mix", epoch)
        active = list(range(len(streams)))

        def mixed() -> Iterator[tuple[str, str]]:
            while active:
                if len(active) == 1:
                    yield from streams[active[0]]
                    return
                at = rng.choices(active, [max(left[i], 1.0) for i in active])[0]
                item = next(streams[at], None)
                if item is None:
                    active.remove(at)
                    continue
                left[at] -= 1
                yield item

        return shuffled(mixed(), self.data.shuffle_buffer, self._rng("shuffle", epoch))

    def batches(
        self, epoch: int, encode: Encode, max_tokens: int, max_len: int, specials: tuple[int, int, int]
    ) -> Iterator[Batch]:
        """This epoch's batches: ``[data] bucket`` pairs at a time tokenized (``encode``), pairs of
        more than ``max_len`` pieces a side dropped, the rest sorted by length into batches of at
        most ``max_tokens`` padded tokens, given out in random order."""
        self.too_long = 0
        rng = self._rng("batches", epoch)
        stream = self.pairs(epoch)
        while chunk := list(itertools.islice(stream, self.data.bucket)):
            seed = rng.randrange(2**31)
            src = encode([s for s, _ in chunk], seed)
            tgt = encode([t for _, t in chunk], seed + 1)
            keep = [i for i in range(len(chunk)) if len(src[i]) <= max_len and len(tgt[i]) <= max_len]
            self.too_long += len(chunk) - len(keep)
            src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]
            lengths = [max(len(a), len(b)) + 1 for a, b in zip(src, tgt, strict=True)]
            for idx in token_batches(lengths, max_tokens, shuffle=True, seed=seed):
                yield make_batch([src[i] for i in idx], [tgt[i] for i in idx], *specials)
