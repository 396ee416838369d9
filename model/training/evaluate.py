"""Score a checkpoint on a test set with sacreBLEU.

    python -m model.training.evaluate --weights weights/de-en --src FILE --ref FILE \
        [--beam-size N] [--batch-size N] [--device D] [--dtype P] [--limit N] [--threads N]
    python -m model.training.evaluate --weights weights/de-en --then weights/en-fr --split val   # through English
    python -m model.training.evaluate --weights weights/many-to-many --direction de-fr --split val
    python -m model.training.evaluate --weights runs/x/model --split val --length-penalty 1.8 --hypotheses x.txt

prints one JSON line: bleu (cased, 13a), bleu_lc (lowercased), chrf, their sacreBLEU signatures,
sentences, seconds,
beam_size, length_penalty, dtype and the linear kernel that ran (``model.engine.kernels``). With ``--then`` the first
checkpoint's output is the second's input (a pivot, as the service runs a pair without a model of
its own), each leg decoded with its own card's settings; the score is of the second's output.
``--length-penalty`` sets the scored leg's alpha (sweeps on val); ``--hypotheses`` keeps its
translations, so two systems can be tested in pairs (``sacrebleu REF -i A B --paired-bs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sacrebleu
import torch

from model import checkpoint
from model.engine import loading
from model.engine.allocator import tune_malloc
from model.engine.options import DecodingOptions
from model.engine.translator import Translator
from model.network.precision import PRECISIONS
from model.training.data import Parallel, read_lines, read_parallel, split_file, write_lines
from model.training.multi30k import default_dir, ensure_split_files
from model.training.progress import progress

log = logging.getLogger(__name__)


def score_translations(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, Any]:
    """Corpus scores: BLEU cased (13a), BLEU lowercased, chrF, and each one's sacreBLEU
    signature (its settings and version, so a score can be reproduced and compared)."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    metrics = {
        "bleu": sacrebleu.metrics.BLEU(),
        "bleu_lc": sacrebleu.metrics.BLEU(lowercase=True),
        "chrf": sacrebleu.metrics.CHRF(),
    }
    out: dict[str, Any] = {}
    for name, metric in metrics.items():
        out[name] = round(metric.corpus_score(list(hyps), [list(refs)]).score, 2)
    out["signatures"] = {name: str(metric.get_signature()) for name, metric in metrics.items()}
    return out


def translate_all(
    translator: Translator, src: Sequence[str], options: DecodingOptions, batch_size: int = 64
) -> list[str]:
    """Translations of ``src``, in order, in chunks that keep length-sorting effective yet bounded."""
    hyps: list[str] = []
    with progress(len(src), f"translating (beam {options.beam_size})") as bar:
        for i in range(0, len(src), batch_size * 8):
            chunk = translator.translate(
                src[i : i + batch_size * 8], options, max_batch_tokens=batch_size * 32, on_done=bar.update
            )
            hyps.extend(t.text for t in chunk)
    return hyps


def evaluate(
    translator: Translator,
    src: Sequence[str],
    ref: Sequence[str],
    options: DecodingOptions,
    batch_size: int = 64,
    keep: list[str] | None = None,
) -> dict[str, Any]:
    """Translate ``src`` and score against ``ref``; timing covers tokenization to text. The
    translations are appended to ``keep`` when given (for paired significance tests)."""
    start = time.perf_counter()
    hyps = translate_all(translator, src, options, batch_size)
    seconds = time.perf_counter() - start
    if keep is not None:
        keep.extend(hyps)
    return {
        **score_translations(hyps, ref),
        "sentences": len(src),
        "seconds": round(seconds, 3),
        "beam_size": options.beam_size,
    }


def measure_checkpoint(
    folder: Path,
    data_dir: str,
    source: str,
    target: str,
    splits: Sequence[str],
    device: str = "cpu",
    limit: int = 0,
) -> dict[str, Any]:
    """Greedy and recommended-beam scores of a checkpoint on several splits (for metrics.json);
    ``limit`` > 0 scores only the first sentences of each split (smoke runs); a many-to-many
    model's sources are led by the target's tag (``Checkpoint.source_prefix``)."""
    sets = {
        split: read_parallel(split_file(data_dir, split, source), split_file(data_dir, split, target)).head(limit)
        for split in splits
    }
    return measure_sets(folder, sets, source, target, device)


def measure_sets(
    folder: Path, sets: dict[str, Parallel], source: str, target: str, device: str = "cpu"
) -> dict[str, Any]:
    """``measure_checkpoint`` on parallel texts in memory, by name (a run's own corpora)."""
    ckpt = loading.load(folder, device)
    translator = Translator(ckpt.model, ckpt.tokenizer, ckpt.source_prefix(target))
    direction = f"{source}-{target}"
    beam = loading.decoding_options(ckpt.meta, direction=direction)
    greedy = loading.decoding_options(ckpt.meta, 1, direction=direction)
    out: dict[str, Any] = {}
    for split, data in sets.items():
        for name, options in (("greedy", greedy), (f"beam{beam.beam_size}", beam)):
            result = evaluate(translator, data.src, data.tgt, options)
            keys = ("bleu", "bleu_lc", "chrf", "sentences", "signatures")
            out.setdefault(split, {})[name] = {k: result[k] for k in keys}
            log.info("%s %s: %s", split, name, out[split][name])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", required=True, type=Path, help="checkpoint folder")
    parser.add_argument(
        "--then", type=Path, help="a second checkpoint that translates the first's output (a pivot: de-en then en-fr)"
    )
    parser.add_argument(
        "--direction", help="SRC-TGT: one of a many-to-many checkpoint's directions (its target tag leads each source)"
    )
    parser.add_argument("--src", type=Path, help="source sentences (plain or .gz)")
    parser.add_argument("--ref", type=Path, help="reference translations (plain or .gz)")
    parser.add_argument(
        "--split", help="instead of --src/--ref: a Multi30k split (e.g. test_2016_flickr) in the checkpoint's "
        "direction, downloaded and verified when missing (translator data multi30k)"
    )  # fmt: skip
    parser.add_argument("--data-dir", type=Path, help="Multi30k folder for --split (default: translator data's)")
    parser.add_argument("--beam-size", type=int, help="default: the model card's")
    parser.add_argument("--length-penalty", type=float, help="GNMT alpha of the scored leg (default: the model card's)")
    parser.add_argument(
        "--hypotheses",
        type=Path,
        help="also write the scored translations here, one a line (.gz: gzip), e.g. for sacrebleu's --paired-bs",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per batch (approx.)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=PRECISIONS, help="inference precision")
    parser.add_argument("--limit", type=int, help="only the first N sentences")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument(
        "--shortlist",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="score only the checkpoint's lexical shortlist where it ships one (float precisions), as the service does",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    tune_malloc()
    if (args.split is None) == (args.src is None or args.ref is None):
        parser.error("give --src and --ref, or --split")
    ckpt = loading.load(args.weights, args.device, args.dtype)
    served = checkpoint.directions(ckpt.meta)
    if args.direction is None and len(served) > 1:
        parser.error(f"{args.weights} is a many-to-many checkpoint: name --direction ({', '.join(args_of(served))})")
    pair = served[0] if args.direction is None else tuple(args.direction.split("-", 1))
    if pair not in served:
        parser.error(f"--direction {args.direction}: {args.weights} translates {', '.join(args_of(served))}")
    prefix = ckpt.source_prefix(pair[1])
    then = loading.load(args.then, args.device, args.dtype) if args.then else None
    if then is not None and then.meta.get("source_lang") != pair[1]:
        parser.error(f"--then translates from {then.meta.get('source_lang')}, --weights into {pair[1]}")
    if args.split is not None:
        source, target = pair[0], str(then.meta["target_lang"] if then else pair[1])
        folder = ensure_split_files(args.data_dir or default_dir(), [args.split], [source, target])
        args.src, args.ref = split_file(str(folder), args.split, source), split_file(str(folder), args.split, target)
    src, ref = read_lines(args.src), read_lines(args.ref)
    if args.limit:
        src, ref = src[: args.limit], ref[: args.limit]
    start = time.perf_counter()
    if then is not None:  # the first leg; the second is scored (and timed from here) below
        first = loading.decoding_options(ckpt.meta, args.beam_size, direction="-".join(pair))
        leg = Translator(ckpt.model, ckpt.tokenizer, prefix, loading.use_shortlist(ckpt, args.shortlist))
        src, ckpt, prefix = translate_all(leg, src, first, args.batch_size), then, ()
        pair = checkpoint.directions(then.meta)[0]
    short = loading.use_shortlist(ckpt, args.shortlist)
    options = loading.decoding_options(ckpt.meta, args.beam_size, direction="-".join(pair))
    if args.length_penalty is not None:
        options = dataclasses.replace(options, length_penalty=args.length_penalty)
    hyps: list[str] = []
    result = evaluate(Translator(ckpt.model, ckpt.tokenizer, prefix, short), src, ref, options, args.batch_size, hyps)
    result["seconds"] = round(time.perf_counter() - start, 3)
    result["length_penalty"] = options.length_penalty
    if args.hypotheses is not None:
        write_lines(args.hypotheses, hyps)
    vocabulary = loading.vocabulary_label(short)
    print(json.dumps({**result, "dtype": args.dtype, "kernel": ckpt.plan.kernel, "vocabulary": vocabulary}))


def args_of(pairs: Sequence[tuple[str, str]]) -> list[str]:
    return [f"{s}-{t}" for s, t in pairs]


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
