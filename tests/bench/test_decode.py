"""The decoding benchmark: the naive baseline, batching helpers and the CLI's JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import naive
from bench.decode import batch_limit, in_length_order, in_streams
from model.engine.decoding import max_steps
from model.engine.options import DecodingOptions
from model.engine.translator import Translator
from model.network.tokenizer import Tokenizer
from model.training.data import read_lines
from tests.factories import random_model
from tests.helpers import ROOT

KEYS = {
    "system",
    "device",
    "beam_size",
    "sentences",
    "seconds",
    "sentences_per_s",
    "tokens_per_s",
    "peak_mem_mb",
    "setup_mem_mb",
    "bleu",
}


def test_naive_decoder_matches_cached_greedy(tiny_tokenizer: Tokenizer, data_dir: Path) -> None:
    model = random_model(tiny_tokenizer.vocab_size, eos_scale=12.0)
    texts = read_lines(data_dir / "test_2016_flickr.de.gz")[:6]
    options = DecodingOptions(beam_size=1, max_length_a=0.5, max_length_b=4)  # per-sentence limits
    ids = tiny_tokenizer.encode(texts)
    cached = [h[0].ids for h in Translator(model, tiny_tokenizer).decode_ids(ids, options)]
    assert [tuple(x) for x in naive.translate(model, tiny_tokenizer, texts, options)] == cached


def test_length_order_batches_and_limits() -> None:
    items = ["ccc", "a", "bb", "dddd", "e"]
    seen: list[list[str]] = []

    def fn(chunk: list[str]) -> list[str]:
        seen.append(chunk)
        return [x.upper() for x in chunk]

    assert in_length_order(items, [len(x) for x in items], 2, fn) == [x.upper() for x in items]
    assert seen == [["a", "e"], ["bb", "ccc"], ["dddd"]]
    options = DecodingOptions(max_length_a=1.5, max_length_b=10)
    assert batch_limit([3, 7], options, 500) == max_steps([8], options, 500)[0]  # longest + EOS
    assert batch_limit([300], options, 40) == 40


def test_streams_deal_the_sorted_batches_in_turn_each_on_a_thread_of_its_own() -> None:
    items = ["ccc", "a", "bb", "dddd", "e", "ff", "g"]
    seen: list[list[tuple[str, list[str]]]] = [[], []]

    def stream(k: int) -> Callable[[list[str]], list[str]]:
        def fn(chunk: list[str]) -> list[str]:
            seen[k].append((threading.current_thread().name, chunk))
            return [x.upper() for x in chunk]

        return fn

    assert in_streams(items, [len(x) for x in items], 2, [stream(0), stream(1)]) == [x.upper() for x in items]
    assert [chunk for _, chunk in seen[0]] == [["a", "e"], ["ff", "ccc"]]
    assert [chunk for _, chunk in seen[1]] == [["g", "bb"], ["dddd"]]
    names = {name for calls in seen for name, _ in calls}
    assert len(names) == 2 and threading.current_thread().name not in names
    one: list[list[str]] = []

    def alone(chunk: list[str]) -> list[str]:
        one.append(chunk)
        assert threading.current_thread() is threading.main_thread()
        return chunk

    assert in_streams(items, [len(x) for x in items], 3, [alone]) == items
    assert one == [["a", "e", "g"], ["bb", "ff", "ccc"], ["dddd"]]

    def failing(chunk: list[str]) -> list[str]:
        raise ValueError("a stream failed")

    with pytest.raises(ValueError, match="a stream failed"):
        in_streams(items, [len(x) for x in items], 2, [stream(0), failing])


def run_cli(weights: Path, data_dir: Path, *args: str) -> list[dict[str, object]]:
    cmd = [sys.executable, "-m", "bench.decode", "--weights", str(weights), "--limit", "8", "--naive-limit", "4"]
    cmd += ["--threads", "1", "--warmup", "2", "--data-dir", str(data_dir), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.slow
def test_cli_prints_one_json_line_per_system(tiny_weights_dir: Path, data_dir: Path) -> None:
    rows = run_cli(tiny_weights_dir / "de-en", data_dir, "--no-isolate")
    assert [r["system"] for r in rows] == ["ours", "ctranslate2", "ctranslate2-int8", "marian", "naive"]
    for row in rows:
        assert set(row) >= KEYS, row
        assert row["device"] == "cpu" and row["beam_size"] == 1
        assert isinstance(row["seconds"], float) and row["seconds"] > 0
        assert isinstance(row["tokens_per_s"], float) and row["tokens_per_s"] > 0
        assert isinstance(row["peak_mem_mb"], float) and row["peak_mem_mb"] >= 0
        assert isinstance(row["setup_mem_mb"], float) and 0 <= row["setup_mem_mb"] <= row["peak_mem_mb"] + 1
    assert [r["sentences"] for r in rows] == [8, 8, 8, 8, 4]
    # greedy, same weights, same length limits: the same translations, hence the same BLEU
    by_name = {r["system"]: r for r in rows}
    assert by_name["ours"]["bleu"] == by_name["ctranslate2"]["bleu"] == by_name["marian"]["bleu"]


@pytest.mark.slow
def test_cli_runs_each_system_in_its_own_process(tiny_weights_dir: Path, data_dir: Path) -> None:
    rows = run_cli(tiny_weights_dir / "de-en", data_dir, "--systems", "ours,ctranslate2", "--beam-size", "2")
    assert [(r["system"], r["beam_size"], r["sentences"]) for r in rows] == [("ours", 2, 8), ("ctranslate2", 2, 8)]


@pytest.mark.slow
def test_streams_decode_the_same_translations(tiny_weights_dir: Path, data_dir: Path) -> None:
    """Batches of 2 sentences dealt to two streams of one thread each: the same translations as one stream."""
    args = ("--systems", "ours,ctranslate2", "--threads", "2", "--batch-size", "2")
    one = run_cli(tiny_weights_dir / "de-en", data_dir, *args)
    two = run_cli(tiny_weights_dir / "de-en", data_dir, *args, "--streams", "2")
    assert [(r["system"], r["streams"]) for r in one] == [("ours", 1), ("ctranslate2", 1)]
    assert [(r["system"], r["streams"]) for r in two] == [("ours", 2), ("ctranslate2", 2)]
    assert [r["bleu"] for r in one] == [r["bleu"] for r in two]


@pytest.mark.slow
def test_rounds_report_the_median_round_of_each_system(tiny_weights_dir: Path, data_dir: Path) -> None:
    rows = run_cli(tiny_weights_dir / "de-en", data_dir, "--systems", "ours,ctranslate2", "--rounds", "3")
    assert [r["system"] for r in rows] == ["ours", "ctranslate2"]
    for row in rows:
        rounds = row["rounds_s"]
        assert len(rounds) == 3 and row["seconds"] == sorted(rounds)[1]
        assert len(row["runs_s"]) == 3  # --repeat's default passes within each round
