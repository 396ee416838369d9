"""``python -m model.training.plot``: a grid of one heatmap per head, written as a valid PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from model.engine import loading
from model.engine.options import DecodingOptions
from model.engine.translator import Translator
from model.training.plot import (
    grid_shape,
    layer_maps,
    main,
    plot_training,
    plot_translation,
    read_log,
    translate_with_attention,
)
from tests.helpers import ROOT

TEXT = "Zwei junge Männer spielen Fußball auf einer Wiese."
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GREEDY = DecodingOptions(beam_size=1, max_length=12)


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_weights_dir: Path) -> Path:
    """Its own random-init checkpoint (never the shipped weights), so this test always runs."""
    return tiny_weights_dir / "de-en"


@pytest.fixture(scope="module")
def translator(tiny_checkpoint: Path) -> Translator:
    ckpt = loading.load(tiny_checkpoint)
    return Translator(ckpt.model, ckpt.tokenizer)


def assert_png(path: Path) -> np.ndarray:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert float(image[..., :3].std()) > 0.05  # a drawing, not a blank page
    return image


def test_command_writes_a_png(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "plots" / "cross.png"
    argv = ["--weights", str(tiny_checkpoint), "--text", TEXT, "--out", str(out), "--beam-size", "2"]
    assert main(argv) == 0
    assert_png(out)


@pytest.mark.slow
def test_module_runs_as_a_command(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "encoder-words.png"
    args = ["--weights", str(tiny_checkpoint), "--text", TEXT, "--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "model.training.plot", *args, "--kind", "encoder", "--layer", "0", "--level", "word"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert_png(out)


def test_bad_layer_is_a_clear_error(tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "none.png"
    assert main(["--weights", str(tiny_checkpoint), "--text", TEXT, "--out", str(out), "--layer", "9"]) == 2
    assert "layer 9 out of range" in caplog.text and not out.exists()


@pytest.mark.parametrize("kind", ["cross", "encoder", "decoder"])
def test_figure_has_one_axes_per_head_with_tokens(translator: Translator, kind: str) -> None:
    fig = plot_translation(translator, TEXT, kind=kind, layer=0, options=GREEDY)
    heads = [ax for ax in fig.axes if str(ax.get_label()).startswith("head ")]
    n_heads = translator.config.n_heads
    assert [ax.get_label() for ax in heads] == [f"head {h}" for h in range(n_heads)]
    assert len(fig.axes) == n_heads + 1  # plus the shared colour bar
    _, result = translate_with_attention(translator, TEXT, GREEDY)
    selected = layer_maps(result, kind, 0)
    for ax in heads:
        assert [t.get_text() for t in ax.get_xticklabels()] == list(selected.keys)
        assert [t.get_text() for t in ax.get_yticklabels()] == list(selected.queries)
    assert TEXT in fig.get_suptitle().replace("\n", " ")


def test_word_level_maps_merge_pieces(translator: Translator) -> None:
    _, result = translate_with_attention(translator, TEXT, GREEDY)
    words = layer_maps(result, "cross", 1, level="word")
    assert words.maps.shape == (translator.config.n_heads, len(words.queries), len(words.keys))
    assert "Fußball" in words.keys and words.keys[-1] == "</s>"
    assert not any(k.startswith("▁") for k in words.keys)
    np.testing.assert_allclose(words.maps.sum(-1), 1.0, rtol=1e-5)


def test_grid_shape() -> None:
    assert grid_shape(1) == (1, 1)
    assert grid_shape(4) == (2, 2)
    assert grid_shape(8) == (2, 4)
    assert grid_shape(3) == (2, 2)


RECORDS = [
    {"epoch": 1, "step": 10, "train_loss": 6.0, "valid_loss": 5.5, "valid_bleu": 3.0, "lr": 1e-4, "tokens_per_s": 1.0,
     "seconds": 1.0},
    {"epoch": 2, "step": 20, "train_loss": 4.0, "valid_loss": 4.2, "valid_bleu": 12.5, "lr": 5e-4, "tokens_per_s": 1.0,
     "seconds": 1.0},
    {"epoch": 3, "step": 30, "train_loss": 3.1, "valid_loss": 3.9, "valid_bleu": 11.0, "lr": 4e-4, "tokens_per_s": 1.0,
     "seconds": 1.0},
]  # fmt: skip


def write_log(run: Path, records: list[dict[str, float]]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_training_curves_plot_each_epoch_record(tmp_path: Path) -> None:
    write_log(tmp_path / "run", [*RECORDS[:2], {**RECORDS[1], "valid_bleu": 12.0}, RECORDS[2]])  # epoch 2 resumed
    records = read_log(tmp_path / "run")
    assert [r["epoch"] for r in records] == [1, 2, 3] and records[1]["valid_bleu"] == 12.0  # the last record wins
    fig = plot_training(records)
    panels = {ax.get_label(): ax for ax in fig.axes}
    train, valid = panels["loss"].get_lines()
    assert list(train.get_ydata()) == [6.0, 4.0, 3.1] and list(valid.get_ydata()) == [5.5, 4.2, 3.9]
    assert list(panels["lr"].get_lines()[0].get_ydata()) == [1e-4, 5e-4, 4e-4]
    assert list(panels["bleu"].get_lines()[0].get_xdata()) == [1, 2, 3]
    assert "best 12.00 (epoch 2)" in [t.get_text() for t in panels["bleu"].texts]


def test_plot_training_command_writes_the_run_picture(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_log(tmp_path / "run", RECORDS)
    assert main(["training", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["training", str(tmp_path / "nothing-here")]) == 2
    assert "log.jsonl not found" in caplog.text
