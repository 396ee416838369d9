"""Fine-tuning from the corrections users send, end to end: suggestions posted to a real server,
exported with ``translator suggestions export``, a short ``translator train --init`` of the
shipped de-en model on them mixed with a share of Multi30k, the new checkpoint served, and the
corrected sentences now translated as suggested, while the held-in test set's BLEU stays within
0.5 of the shipped model's."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from model.engine import loading
from model.engine.translator import Translator
from model.training.data import read_lines
from model.training.evaluate import score_translations, translate_all
from tests.helpers import ROOT, SHIPPED, require, running_server

pytestmark = [pytest.mark.server, pytest.mark.train, pytest.mark.usefixtures("fused_kernels")]

# Sentences of Multi30k's domain the shipped model gets wrong (an unknown word garbled), and the
# translations a user suggests.
CORRECTIONS = {
    "Eine Frau backt einen Kuchen in der Küche.": "A woman is baking a cake in the kitchen.",  # shipped: "putting"
    "Der Bäcker verkauft frische Brezeln.": "The baker is selling fresh pretzels.",  # shipped: "colls"
}
HELD_IN = 1000  # test_2016_flickr, whole: never trained on, scored before and after

RECIPE = ROOT / "configs" / "finetune" / "de-en.toml"  # (docs/training.md, "Fine-tuning")


def recipe(data_dir: Path, corrections: Path) -> str:
    """The shipped recipe as a user runs it, on this Multi30k folder and these corrections; validation
    on 20 sentences and one thread (the test's time)."""
    text = RECIPE.read_text()
    for old, new in [('dir = "../shared/data/multi30k"', f'dir = "{data_dir}"'), ("corrections/", f"{corrections}/"),
                     ("eval_limit = 200", "eval_limit = 20"), ("[optim]", "[optim]\nthreads = 1")]:  # fmt: skip
        assert old in text, old
        text = text.replace(old, new)
    return text


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )


def held_in_bleu(folder: Path, data_dir: Path) -> float:
    """BLEU of the checkpoint on the held-in sentences, decoded as the service decodes (the model
    card's beam and length penalty, its shortlist)."""
    ckpt = loading.load(folder)
    translator = Translator(ckpt.model, ckpt.tokenizer, shortlist=loading.use_shortlist(ckpt))
    src = read_lines(data_dir / "test_2016_flickr.de.gz")[:HELD_IN]
    ref = read_lines(data_dir / "test_2016_flickr.en.gz")[:HELD_IN]
    hyps = translate_all(translator, src, loading.decoding_options(ckpt.meta))
    return float(score_translations(hyps, ref)["bleu"])


def translate(url: str, texts: list[str]) -> list[str]:
    response = httpx.post(f"{url}/translate", json={"q": texts, "source": "de", "target": "en"}, timeout=120)
    assert response.status_code == 200, response.text
    return list(response.json()["translatedText"])


def test_suggestions_fine_tune_the_served_model(tmp_path: Path, data_dir: Path) -> None:
    require(SHIPPED.is_dir(), f"shipped weights not found at {SHIPPED}")
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "de-en").symlink_to(SHIPPED)
    service_data = tmp_path / "service"
    env = {"TRANSLATOR_WEIGHTS_DIR": str(shipped), "TRANSLATOR_SUGGESTIONS": "true",
           "TRANSLATOR_DATA_DIR": str(service_data), "TRANSLATOR_THREADS": "1"}  # fmt: skip
    sources = list(CORRECTIONS)
    with running_server(env) as url:
        before = translate(url, sources)
        assert all(b != s for b, s in zip(before, CORRECTIONS.values(), strict=True)), before
        for source, suggestion in CORRECTIONS.items():
            body = {"q": source, "s": suggestion, "source": "de", "target": "en"}
            assert httpx.post(f"{url}/suggest", json=body, timeout=30).status_code == 200

    corrections = tmp_path / "corrections"
    done = cli("suggestions", "export", "--data-dir", str(service_data), "--out", str(corrections))
    assert done.returncode == 0 and done.stdout.strip() == f"de-en: {len(CORRECTIONS)} pairs", done.stderr[-2000:]

    config = tmp_path / "finetune.toml"
    config.write_text(recipe(data_dir, corrections))
    run = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the shipped model's score on one core while the fine-tuning takes the other
    try:
        with ThreadPoolExecutor(1) as pool:
            start = pool.submit(held_in_bleu, SHIPPED, data_dir)
            done = cli("train", "--config", str(config), "--init", str(SHIPPED), "--out", str(run),
                       "--device", "cpu", "--no-score")  # fmt: skip
            start_bleu = start.result()
    finally:
        torch.set_num_threads(threads)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((run / "data.json").read_text())
    assert report["train"]["suggestions"]["kept"] == len(CORRECTIONS)
    meta = loading.load(run / "model").meta
    assert meta["training"]["config"]["init"] == str(SHIPPED)
    card = json.loads((SHIPPED / "config.json").read_text())
    # the card's architecture (the dropout: the config's; keys newer than the card at their defaults)
    assert {k: meta["model"][k] for k in card["model"]} == {**card["model"], "dropout": 0.1}
    assert {k: meta["decoding"][k] for k in card["decoding"]} == card["decoding"]  # beam 5, its length penalty
    assert (run / "model" / "spm.model").read_bytes() == (SHIPPED / "spm.model").read_bytes()

    tuned = tmp_path / "tuned"
    tuned.mkdir()
    (tuned / "de-en").symlink_to(run / "model")
    torch.set_num_threads(1)  # the new model's score on one core while the server starts on the other
    try:
        with ThreadPoolExecutor(1) as pool:
            now = pool.submit(held_in_bleu, run / "model", data_dir)
            with running_server({**env, "TRANSLATOR_WEIGHTS_DIR": str(tuned)}) as url:
                assert translate(url, sources) == list(CORRECTIONS.values())
            now_bleu = now.result()
    finally:
        torch.set_num_threads(threads)
    assert abs(now_bleu - start_bleu) <= 0.5, f"held-in BLEU {start_bleu:.2f} -> {now_bleu:.2f}"
