"""Pictures (matplotlib, Agg; no display needed): every head of one attention layer as a grid of
heatmaps, or a training run's curves.

    translator plot [attention] --weights weights/de-en --text "Zwei Männer spielen Fußball." \\
        --out attn.png [--kind cross|encoder|decoder] [--layer N] [--level subword|word] [--beam-size N]
    translator plot training RUN_DIR [--out FILE]   # loss, learning rate, val BLEU per epoch

(``python -m model.training.plot`` takes the same arguments.) The training picture reads the run's
``log.jsonl`` (one record per epoch, written by ``translator train``) and is written to
``RUN_DIR/training.png`` unless ``--out`` says otherwise.

Rows are queries, columns are keys: for ``cross`` the target tokens attend to the source
tokens, for ``encoder`` the source to itself, for ``decoder`` the target to the tokens it reads
(``<s>`` plus the hypothesis). The translation is decoded as usual and the maps come from one
teacher-forced pass over it, so they belong to exactly the translation in the title.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from model import checkpoint
from model.engine import loading
from model.engine.options import DecodingOptions
from model.engine.translator import AttentionResult, Translator
from model.network.attention_words import merge_map, merge_pieces
from model.network.config import ModelConfig

if TYPE_CHECKING:  # matplotlib is the optional ``plot`` extra: imported where a picture is drawn,
    # so every command's --help (and ``translator plot --help``) runs in an install without it
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

INSTALL_HINT = "translator plot needs matplotlib, an optional dependency: pip install 'transformer-translator[plot]'"

log = logging.getLogger(__name__)

KINDS = ("cross", "encoder", "decoder")
LEVELS = ("subword", "word")
TITLES = {"cross": "cross-attention", "encoder": "encoder self-attention", "decoder": "decoder self-attention"}


@dataclass(frozen=True)
class LayerMaps:
    """The maps of every head of one layer: ``maps`` is (H, Q, K); tokens label the Q and K axes."""

    kind: str
    layer: int
    maps: np.ndarray
    queries: tuple[str, ...]
    keys: tuple[str, ...]


def translate_with_attention(
    translator: Translator, text: str, options: DecodingOptions
) -> tuple[str, AttentionResult]:
    """Decode ``text`` and return (translation, maps of the returned hypothesis)."""
    src_ids = translator.encode([text])[0]
    hyp = translator.decode_ids([src_ids], options)[0][0]
    translation = translator.tokenizer.decode([hyp.ids])[0]
    return translation, translator.attention(src_ids, hyp.ids)


def layer_maps(result: AttentionResult, kind: str, layer: int, level: str = "subword") -> LayerMaps:
    """Pick one kind and layer of ``result``; at word level merge pieces into words."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    full = getattr(result, kind)  # (L, H, Q, K)
    if not 0 <= layer < full.shape[0]:
        raise ValueError(f"layer {layer} out of range: the {kind} maps have layers 0..{full.shape[0] - 1}")
    queries, keys = {
        "cross": (result.target, result.source),
        "encoder": (result.source, result.source),
        "decoder": (result.target, result.target_input),
    }[kind]
    maps = full[layer].float().numpy()  # (H, Q, K)
    if level == "word":
        queries_w, query_groups = merge_pieces(queries)
        keys_w, key_groups = merge_pieces(keys)
        return LayerMaps(kind, layer, merge_map(maps, query_groups, key_groups), tuple(queries_w), tuple(keys_w))
    return LayerMaps(kind, layer, maps, tuple(queries), tuple(keys))


def require_matplotlib() -> None:
    """``SystemExit`` with the install hint where matplotlib is missing (the commands call it once
    their arguments are parsed, so --help never needs it)."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name != "matplotlib":
            raise
        raise SystemExit(INSTALL_HINT) from None


def new_figure(figsize: tuple[float, float]) -> Figure:
    """A constrained-layout figure on the Agg canvas (no display)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def grid_shape(heads: int) -> tuple[int, int]:
    """(rows, cols): 2 columns up to 4 heads, 4 beyond (the 8-head figure is 2 x 4)."""
    cols = 1 if heads == 1 else 2 if heads <= 4 else 4
    return math.ceil(heads / cols), cols


def plot_layer(selected: LayerMaps, title: str = "", heads: Sequence[int] | None = None) -> Figure:
    """A figure with one heatmap axes per head (labelled ``head N``) and a shared colour bar."""
    n_heads, n_queries, n_keys = selected.maps.shape
    names = list(heads) if heads is not None else list(range(n_heads))
    rows, cols = grid_shape(n_heads)
    panel_w, panel_h = max(3.0, 0.24 * n_keys + 1.2), max(2.6, 0.24 * n_queries + 1.0)
    fig = new_figure(figsize=(cols * panel_w + 1.0, rows * panel_h + 1.0))
    vmax = max(float(selected.maps.max()), 1e-6)
    image = None
    for index in range(n_heads):
        ax = fig.add_subplot(rows, cols, index + 1, label=f"head {names[index]}")
        image = ax.imshow(selected.maps[index], cmap="viridis", vmin=0.0, vmax=vmax, aspect="equal")
        _label_axes(ax, selected, index, cols)
        ax.set_title(f"head {names[index]}", fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=fig.axes, shrink=0.6, label="attention weight")
    if title:
        width_chars = int(fig.get_figwidth() * 11)  # about 11 characters of 11 pt text per inch
        fig.suptitle("\n".join(textwrap.fill(line, width_chars) for line in title.splitlines()), fontsize=11)
    return fig


def _label_axes(ax: Axes, selected: LayerMaps, index: int, cols: int) -> None:
    """Tokens on both axes; the query axis name only on the first column."""
    ax.set_xticks(range(len(selected.keys)), selected.keys, rotation=90, fontsize=8)
    ax.set_yticks(range(len(selected.queries)), selected.queries, fontsize=8)
    if index % cols == 0:
        ax.set_ylabel("query", fontsize=9)
    ax.set_xlabel("key", fontsize=9)


def figure_title(text: str, translation: str, selected: LayerMaps) -> str:
    return f"{TITLES[selected.kind]}, layer {selected.layer}\n{text}  →  {translation}"


def resolve_layer(config: ModelConfig, kind: str, layer: int) -> int:
    """Check ``layer`` against the stack ``kind`` comes from (before any decoding); -1 is the last."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    n_layers = config.encoder_layers if kind == "encoder" else config.decoder_layers
    if not -n_layers <= layer < n_layers:
        raise ValueError(f"layer {layer} out of range: the {kind} maps have layers 0..{n_layers - 1}")
    return layer % n_layers


def plot_translation(
    translator: Translator,
    text: str,
    kind: str = "cross",
    layer: int = -1,
    level: str = "subword",
    options: DecodingOptions | None = None,
) -> Figure:
    """Translate ``text`` and plot all heads of one layer (``layer`` -1: the last)."""
    layer = resolve_layer(translator.config, kind, layer)
    translation, result = translate_with_attention(translator, text, options or DecodingOptions())
    selected = layer_maps(result, kind, layer, level)
    return plot_layer(selected, figure_title(text, translation, selected))


def read_log(run_dir: Path) -> list[dict[str, float]]:
    """The epoch records of a training run (``RUN_DIR/log.jsonl``), in epoch order; a resumed
    run's repeated epochs count once (the last record wins)."""
    path = run_dir / "log.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} not found: is {run_dir} a training run folder?")
    by_epoch: dict[int, dict[str, float]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            by_epoch[int(record["epoch"])] = record
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}, line {number}: not an epoch record ({err})") from None
    if not by_epoch:
        raise ValueError(f"{path} has no epoch records yet")
    return [by_epoch[e] for e in sorted(by_epoch)]


def plot_training(records: Sequence[dict[str, float]], title: str = "") -> Figure:
    """Three panels over epochs: training and validation loss per token, the learning rate at
    the end of each epoch, and validation BLEU (greedy) with its best epoch marked."""
    epochs = [int(r["epoch"]) for r in records]
    fig = new_figure(figsize=(13, 3.8))
    loss, lr, bleu = (fig.add_subplot(1, 3, i + 1, label=name) for i, name in enumerate(("loss", "lr", "bleu")))
    loss.plot(epochs, [r["train_loss"] for r in records], marker="o", label="train")
    loss.plot(epochs, [r["valid_loss"] for r in records], marker="o", label="validation")
    loss.set(title="loss per token", xlabel="epoch")
    loss.legend()
    lr.plot(epochs, [r["lr"] for r in records], marker="o", color="tab:purple")
    lr.set(title="learning rate (end of epoch)", xlabel="epoch")
    lr.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    scores = [r["valid_bleu"] for r in records]
    bleu.plot(epochs, scores, marker="o", color="tab:green")
    best = max(range(len(scores)), key=scores.__getitem__)
    bleu.annotate(f"best {scores[best]:.2f} (epoch {epochs[best]})", (epochs[best], scores[best]),
                  textcoords="offset points", xytext=(0, -16), ha="center", fontsize=9)  # fmt: skip
    bleu.set(title="validation BLEU (greedy)", xlabel="epoch")
    for ax in (loss, lr, bleu):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return fig


def training_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{_prog()} training", description="Plot loss, learning rate and validation BLEU per epoch."
    )
    parser.add_argument("run_dir", type=Path, help="a training run folder (holds log.jsonl)")
    parser.add_argument("--out", type=Path, help="image file to write (default: RUN_DIR/training.png)")
    parser.add_argument("--dpi", type=int, default=120)
    args = parser.parse_args(argv)
    require_matplotlib()
    try:
        fig = plot_training(read_log(args.run_dir), title=f"training run {args.run_dir.resolve().name}")
    except ValueError as err:
        log.error("%s", err)
        return 2
    out = args.out or args.run_dir / "training.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=args.dpi)
    log.info("wrote %s", out)
    return 0


def _prog() -> str:
    """How this command was called (``translator plot`` or ``python -m model.training.plot``)."""
    return "translator plot" if "translator" in Path(sys.argv[0]).name else "python -m model.training.plot"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"{_prog()} [attention]",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog=f"A training run's curves: {_prog()} training RUN_DIR [--out FILE]",
    )
    parser.add_argument("--weights", required=True, type=Path, help="checkpoint folder, e.g. weights/de-en")
    parser.add_argument("--text", required=True, help="source sentence")
    parser.add_argument("--out", required=True, type=Path, help="image file to write (.png, .svg, .pdf)")
    parser.add_argument("--kind", choices=KINDS, default="cross")
    parser.add_argument("--layer", type=int, default=-1, help="layer index (default -1: the last)")
    parser.add_argument("--level", choices=LEVELS, default="subword")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--dpi", type=int, default=120)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if argv[:1] == ["training"]:
        return training_main(argv[1:])
    args = parse_args(argv[1:] if argv[:1] == ["attention"] else argv)
    require_matplotlib()
    try:
        ckpt = loading.load(args.weights)
        translator = Translator(ckpt.model, ckpt.tokenizer)
        fig = plot_translation(
            translator, args.text, args.kind, args.layer, args.level, DecodingOptions(beam_size=args.beam_size)
        )
    except (checkpoint.CheckpointError, ValueError) as err:
        log.error("%s", err)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=args.dpi)
    log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
