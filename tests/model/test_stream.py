"""The user's corpora ([[data.corpora]], model.training.stream): formats, cleaning with counts,
shards, weights, mixing in bounded memory, and the config that names them."""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from model.training.config import CorpusConfig, DataConfig, load_train_config
from model.training.stream import Seen, StreamedCorpus, merge_scans, read_corpus, scan, shuffled


def write(path: Path, lines: list[str]) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
    return path


def corpus_data(tmp_path: Path, **data: object) -> DataConfig:
    return DataConfig(source="de", target="en", dir=str(tmp_path), **data)  # type: ignore[arg-type]


def sentences(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    words = ["Hund", "Katze", "Haus", "Baum", "rennt", "schläft", "groß", "klein", "rot", "blau"]
    out = []
    for i in range(n):
        src = " ".join(rng.choice(words) for _ in range(rng.randint(2, 8))) + f" {i}."
        out.append((src, src.upper()))
    return out


def test_pairs_of_files_tsv_and_jsonl_are_read_and_cleaned_with_counts_per_reason(tmp_path: Path) -> None:
    pairs = sentences(6)
    write(tmp_path / "a.de.gz", [s for s, _ in pairs] + ["", "kurz", "x" * 1200, pairs[0][0]])
    extra = ["empty source", "a much much longer line here", "y", pairs[0][1]]
    write(tmp_path / "a.en.gz", [t for _, t in pairs] + extra)
    write(tmp_path / "b.tsv", ["id\tde\ten", *(f"{i}\t{s}\t{t}" for i, (s, t) in enumerate(pairs)), "no\tcolumns"])
    rows = [json.dumps({"translation": {"de": s, "en": t}}) for s, t in pairs[:3]]
    write(tmp_path / "c.jsonl", [*rows, "not json", json.dumps({"translation": {"de": "x"}})])
    write(tmp_path / "d.jsonl", [json.dumps({"de": s, "en": t}) for s, t in pairs[3:]])
    data = corpus_data(
        tmp_path,
        corpora=[
            {"files": ["{dir}/a.de.gz", "{dir}/a.en.gz"]},
            {"file": "{dir}/b.tsv", "columns": ["de", "en"], "weight": 2},
            {"file": "{dir}/c.jsonl", "columns": ["translation.de", "translation.en"]},
            {"file": "{dir}/d.jsonl", "split": "valid"},  # keys default to the language codes
        ],
    )
    found = scan(data)
    counts = {i: c.as_dict() for i, c in found.counts.items()}
    assert counts[0] == {
        "read": 10, "kept": 6, "dropped": {"malformed": 0, "empty": 1, "too_long": 1, "ratio": 1, "duplicate": 1}
    }  # fmt: skip
    assert counts[1] == {"read": 7, "kept": 6, "dropped": {**dict.fromkeys(counts[1]["dropped"], 0), "malformed": 1}}
    assert counts[2]["kept"] == 3 and counts[2]["dropped"]["malformed"] == 2
    assert 3 not in counts  # not a training corpus
    assert read_corpus(data.corpora[3], data).src == [s for s, _ in pairs[3:]]
    # duplicates are dropped within a corpus, not across corpora: each corpus is a source of its own
    assert len(found.sample) == 15 and {(p.src, p.tgt) for p in found.sample} == set(pairs)


def test_processes_hold_disjoint_shards_that_together_are_the_single_process_corpus(tmp_path: Path) -> None:
    pairs = sentences(400)
    write(tmp_path / "t.tsv", [f"{s}\t{t}" for s, t in pairs + pairs[:50]])  # 50 duplicates
    data = corpus_data(tmp_path, corpora=[{"file": "{dir}/t.tsv"}, {"file": "{dir}/t.tsv", "split": "valid"}])
    whole = scan(data)
    shards = [scan(data, rank, 3) for rank in range(3)]
    assert whole.counts[0].kept == 400 and whole.counts[0].dropped["duplicate"] == 50
    assert sum(s.counts[0].kept for s in shards) == 400 and all(80 < s.counts[0].kept < 180 for s in shards)
    merged = merge_scans(shards, data.sample_pairs)
    assert merged.counts[0].as_dict() == whole.counts[0].as_dict()
    assert merged.sample == whole.sample  # the tokenizer learns from the same pairs on 1 process or 3
    thirty = corpus_data(tmp_path, corpora=data.corpora, sample_pairs=30)
    small = merge_scans([scan(thirty, r, 3) for r in range(3)], 30)
    assert small.sample == whole.sample[:30]  # the pairs of smallest hash, whatever the shards

    streams = [StreamedCorpus(data, 1, {0: s.counts[0].kept}, rank, 3) for rank, s in enumerate(shards)]
    epoch = [sorted(st.pairs(0)) for st in streams]
    assert sorted(p for part in epoch for p in part) == sorted(pairs)
    assert not set(epoch[0]) & set(epoch[1])


def test_weights_repeat_or_thin_a_corpus_each_epoch(tmp_path: Path) -> None:
    big, small = sentences(1000, seed=1), sentences(20, seed=2)
    write(tmp_path / "big.tsv", [f"{s}\t{t}" for s, t in big])
    write(tmp_path / "small.tsv", [f"{s}\t{t}" for s, t in small])
    corpora = [
        {"file": "{dir}/big.tsv", "weight": 0.25},
        {"file": "{dir}/small.tsv", "weight": 3},
        {"file": "{dir}/small.tsv", "split": "valid"},
    ]
    data = corpus_data(tmp_path, corpora=corpora, shuffle_buffer=50)
    found = scan(data)
    stream = StreamedCorpus(data, 7, {i: c.kept for i, c in found.counts.items()})
    epochs = [list(stream.pairs(e)) for e in (0, 1, 0)]
    assert epochs[0] == epochs[2]  # the epoch's seed: a resumed run reads the same
    counts = Counter(epochs[0])
    assert all(counts[p] == 3 for p in small)  # weight 3: three times an epoch
    drawn = [{p for p in e if p in set(big)} for e in epochs[:2]]
    assert all(200 < len(d) < 300 for d in drawn) and all(counts[p] == 1 for p in drawn[0])
    assert drawn[0] != drawn[1]  # a quarter of the big corpus, drawn anew each epoch
    # mixed: the small corpus's pairs spread over the epoch, not in a block
    where = [i for i, p in enumerate(epochs[0]) if p in set(small)]
    assert where[0] < len(epochs[0]) // 4 and where[-1] > 3 * len(epochs[0]) // 4


def test_the_shuffle_buffer_holds_at_most_its_size() -> None:
    read = 0

    def items() -> Iterator[int]:
        nonlocal read
        for i in range(1000):
            read += 1
            yield i

    out = []
    for item in shuffled(items(), 64, random.Random(0)):
        out.append(item)
        assert read - len(out) <= 64  # items read but not yet given out
    assert sorted(out) == list(range(1000)) and out != list(range(1000))


def test_batches_are_length_bucketed_and_overlong_pairs_left_out(tmp_path: Path) -> None:
    pairs = sentences(300)
    write(tmp_path / "t.tsv", [f"{s}\t{t}" for s, t in pairs] + ["a " * 60 + "\t" + "b " * 60])
    data = corpus_data(tmp_path, corpora=[{"file": "{dir}/t.tsv"}, {"file": "{dir}/t.tsv", "split": "valid"}],
                       bucket=100)  # fmt: skip

    def encode(texts: list[str], seed: int) -> list[list[int]]:  # one id per character: a stand-in tokenizer
        return [[4 + ord(c) % 50 for c in text] for text in texts]

    stream = StreamedCorpus(data, 1, {0: scan(data).counts[0].kept})
    batches = list(stream.batches(0, encode, max_tokens=400, max_len=100, specials=(0, 2, 3)))
    assert stream.too_long == 1
    assert sum(len(b.src) for b in batches) == 300
    for b in batches:
        assert b.src.numel() <= 400 or len(b.src) == 1
    padding = sum(int((b.src == 0).sum()) for b in batches) / sum(b.src.numel() for b in batches)
    assert padding < 0.15  # similar lengths together


def test_corpora_are_checked_where_the_config_names_them(tmp_path: Path) -> None:
    good = {"files": ["a.de", "a.en"]}
    for bad, match in [
        ({"files": ["a.de"]}, "files"),
        ({"files": ["a.de", "a.en"], "file": "b.tsv"}, "not both"),
        ({"file": "b.csv"}, ".tsv or .jsonl"),
        ({"file": "b.jsonl", "columns": [0, 1]}, "keys"),
        ({"files": ["a", "b"], "split": "dev"}, "split"),
        ({"files": ["a", "b"], "weight": 0}, "weight"),
        ({"files": ["a", "b"], "weight": 2, "split": "valid"}, "weights are for training"),
        ({"files": ["a", "b"], "colour": 1}, "unknown keys"),
    ]:
        with pytest.raises(ValueError, match=match):
            DataConfig(corpora=(good, {**good, "split": "valid"}, bad))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no valid corpus"):
        DataConfig(corpora=(good,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one-direction"):
        DataConfig(corpora=(good, {**good, "split": "valid"}), directions=("de-en", "en-de"))  # type: ignore[arg-type]
    assert CorpusConfig(file="x.TSV.gz".lower()).kind == "tsv"
    toml = tmp_path / "c.toml"
    toml.write_text(
        '[data]\nsource = "de"\ntarget = "en"\n'
        '[[data.corpora]]\nfiles = ["a.de.gz", "a.en.gz"]\nweight = 0.5\n'
        '[[data.corpora]]\nfile = "v.jsonl.gz"\nsplit = "valid"\n'
        "[model]\nd_model = 32\nn_heads = 2\n"
    )
    cfg = load_train_config(toml)
    assert [(c.kind, c.split, c.weight) for c in cfg.data.corpora] == [("pair", "train", 0.5), ("jsonl", "valid", 1.0)]
    assert cfg.to_dict()["data"]["corpora"][0]["files"] == ("a.de.gz", "a.en.gz")


def test_the_duplicate_filter_keeps_corpora_and_copies_apart() -> None:
    from model.training.stream import Pair

    seen, pair = Seen(2**16), Pair.of("ein Hund", "a dog")
    assert not seen.add(pair, 1) and seen.add(pair, 1)
    assert not seen.add(pair, 2)  # another corpus, or another read of a weighted one
    assert not Seen(0).add(pair, 1) and not Seen(0).add(pair, 1)  # dedup_mb = 0: off


def test_the_configs_in_the_training_docs_load(tmp_path: Path) -> None:
    """docs/training.md's TOML examples are configs ``load_train_config`` takes as they are."""
    import re

    from tests.helpers import ROOT

    blocks = re.findall(r"```toml\n(.*?)```", (ROOT / "docs" / "training.md").read_text(), re.S)
    assert len(blocks) >= 2
    for i, block in enumerate(blocks):
        path = tmp_path / f"{i}.toml"
        path.write_text(block)
        assert load_train_config(path).data.corpora
