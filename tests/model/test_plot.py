"""``python -m model.plot``: a grid of one heatmap per head, written as a valid PNG."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from model import checkpoint
from model.decoding import DecodingOptions
from model.plot import grid_shape, layer_maps, main, plot_translation, translate_with_attention
from model.translator import Translator
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
    ckpt = checkpoint.load(tiny_checkpoint)
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


def test_module_runs_as_a_command(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "encoder-words.png"
    args = ["--weights", str(tiny_checkpoint), "--text", TEXT, "--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "model.plot", *args, "--kind", "encoder", "--layer", "0", "--level", "word"],
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
