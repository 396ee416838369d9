"""Choose each shipped model's repetition defaults on val, measure their cost on test_2016, and
relate the per-sentence confidence to sentence-level chrF (docs/decoding.md).

    python -m bench.repetition --weights weights --out docs/results/repetition.jsonl

For every checkpoint (a many-to-many one on ``--pairs``, directions it serves): val BLEU at the card's beam with
none and with each candidate (``no_repeat_ngram_size``, ``repetition_penalty``); the strongest whose val
BLEU is within ``--budget`` of none is that direction's choice (none where no candidate is);
test_2016 BLEU and decoding time with none and with it; and whether the out-of-domain sentences
(``OUT_OF_DOMAIN``, letters, chat and web text the caption models never saw) come back with a
loop, with none and with it. ``--confidence`` also writes, per sentence of val and of the
out-of-domain set (English -> German, with references), the confidence and sentence chrF.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import sacrebleu

from model import checkpoint
from model.engine import loading
from model.engine.options import DecodingOptions
from model.engine.translator import Translator
from model.training.data import MULTI30K_DIR, read_lines

# (no_repeat_ngram_size, repetition_penalty): off, then the candidates, strongest first
CANDIDATES = [(4, 1.0)]  # (no_repeat_ngram_size, repetition_penalty), strongest first
# Text the shipped models were not trained on (two from issue 74), with German references.
OUT_OF_DOMAIN = [
    ("Dear Sir or Madam, I am writing to complain about the delayed delivery of my order.",
     "Sehr geehrte Damen und Herren, ich schreibe Ihnen, um mich über die verspätete Lieferung meiner Bestellung zu beschweren."),  # noqa: E501
    ("I love you.", "Ich liebe dich."),
    ("Please find attached the invoice for last month.", "Anbei finden Sie die Rechnung für den letzten Monat."),
    ("The meeting has been moved to Thursday at three o'clock.", "Das Treffen wurde auf Donnerstag um drei Uhr verschoben."),  # noqa: E501
    ("Click here to reset your password.", "Klicken Sie hier, um Ihr Passwort zurückzusetzen."),
    ("We use cookies to improve your experience on our website.",
     "Wir verwenden Cookies, um Ihre Erfahrung auf unserer Website zu verbessern."),
    ("Thank you for your patience and understanding.", "Vielen Dank für Ihre Geduld und Ihr Verständnis."),
    ("The government announced new measures against inflation on Monday.",
     "Die Regierung kündigte am Montag neue Maßnahmen gegen die Inflation an."),
    ("Where is the nearest train station?", "Wo ist der nächste Bahnhof?"),
    ("I'm sorry, I didn't catch your name.", "Entschuldigung, ich habe Ihren Namen nicht verstanden."),
    ("Your package will arrive within three to five business days.",
     "Ihr Paket wird innerhalb von drei bis fünf Werktagen ankommen."),
    ("The software update fixes several security vulnerabilities.",
     "Das Software-Update behebt mehrere Sicherheitslücken."),
    ("Can you call me back tomorrow morning?", "Kannst du mich morgen früh zurückrufen?"),
    ("Prices include VAT and shipping costs.", "Die Preise enthalten die Mehrwertsteuer und die Versandkosten."),
    ("He said he would never do that again.", "Er sagte, er würde das nie wieder tun."),
    ("The results of the study were published in a scientific journal.",
     "Die Ergebnisse der Studie wurden in einer wissenschaftlichen Zeitschrift veröffentlicht."),
    ("Don't forget to bring your passport.", "Vergiss nicht, deinen Reisepass mitzubringen."),
    ("The restaurant is closed on Sundays and public holidays.",
     "Das Restaurant ist sonntags und an Feiertagen geschlossen."),
    ("What time does the concert start?", "Wann beginnt das Konzert?"),
    ("Our customer service is available around the clock.", "Unser Kundendienst ist rund um die Uhr erreichbar."),
]  # fmt: skip


def loops(ids: tuple[int, ...]) -> bool:
    """A loop: some n-gram (n >= 2) followed at once by itself, or a piece three times in a row."""
    n_max = len(ids) // 2
    if any(ids[i] == ids[i + 1] == ids[i + 2] for i in range(len(ids) - 2)):
        return True
    return any(
        ids[i : i + n] == ids[i + n : i + 2 * n] for n in range(2, n_max + 1) for i in range(len(ids) - 2 * n + 1)
    )


def runaway(ids: tuple[int, ...]) -> bool:
    """A runaway loop, as in issue 74's example: a piece five times in a row, or an n-gram (n >= 2)
    three times in a row. ``no_repeat_ngram_size`` 4 rules both out (each would repeat a 4-gram)."""
    if any(len(set(ids[i : i + 5])) == 1 for i in range(len(ids) - 4)):
        return True
    return any(
        ids[i : i + n] == ids[i + n : i + 2 * n] == ids[i + 2 * n : i + 3 * n]
        for n in range(2, len(ids) // 3 + 1)
        for i in range(len(ids) - 3 * n + 1)
    )


def bleu(translator: Translator, sources: list[str], refs: list[str], options: DecodingOptions) -> tuple[float, float]:
    start = time.perf_counter()
    hyps = [t.text for t in translator.translate(sources, options)]
    seconds = time.perf_counter() - start
    return round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2), round(seconds, 2)


def with_candidate(options: DecodingOptions, candidate: tuple[int, float]) -> DecodingOptions:
    return dataclasses.replace(options, no_repeat_ngram_size=candidate[0], repetition_penalty=candidate[1])


def model_rows(
    path: Path, pairs: list[tuple[str, str]], budget: float, data: Path, candidates: list[tuple[int, float]]
) -> list[dict[str, Any]]:
    """One row per direction of the checkpoint at ``path``: val BLEU with none and with every
    candidate; the direction's choice, the strongest candidate within ``budget`` of none (a
    many-to-many card holds the most common one and the others by direction); test BLEU, seconds
    and out-of-domain loops with none and with it."""
    ckpt = loading.load(path)
    shortlist = loading.use_shortlist(ckpt)
    none = (0, 1.0)
    setups = []
    for src, tgt in pairs:
        translator = Translator(ckpt.model, ckpt.tokenizer, ckpt.source_prefix(tgt), shortlist)
        plain = loading.decoding_options(ckpt.meta, direction=f"{src}-{tgt}")
        plain = dataclasses.replace(plain, no_repeat_ngram_size=0, repetition_penalty=1.0)
        val = read_lines(data / f"val.{src}.gz"), read_lines(data / f"val.{tgt}.gz")
        scores = {c: bleu(translator, *val, with_candidate(plain, c))[0] for c in [none, *candidates]}
        setups.append((src, tgt, translator, plain, scores))
    rows = []
    for src, tgt, translator, plain, scores in setups:
        chosen = next((c for c in candidates if scores[c] >= scores[none] - budget), none)
        row: dict[str, Any] = {
            "model": path.name,
            "direction": f"{src}-{tgt}",
            "val_bleu": {str(c): s for c, s in scores.items()},
            "chosen": {"no_repeat_ngram_size": chosen[0], "repetition_penalty": chosen[1]},
        }
        test = read_lines(data / f"test_2016_flickr.{src}.gz"), read_lines(data / f"test_2016_flickr.{tgt}.gz")
        for name, candidate in (("none", none), ("chosen", chosen)):
            score, seconds = bleu(translator, *test, with_candidate(plain, candidate))
            row[f"test_bleu_{name}"], row[f"test_seconds_{name}"] = score, seconds
            if src == "en":
                hyps = translator.translate([s for s, _ in OUT_OF_DOMAIN], with_candidate(plain, candidate))
                ids = [ckpt.tokenizer.encode([h.text])[0] for h in hyps]
                row[f"ood_loops_{name}"] = sum(loops(tuple(i)) for i in ids)
                row[f"ood_examples_{name}"] = [h.text for h in hyps[:2]]
        rows.append(row)
    return rows


def confidence_rows(path: Path, data: Path) -> list[dict[str, Any]]:
    """Per sentence: confidence and sentence chrF, on val and on the out-of-domain set."""
    ckpt = loading.load(path)
    translator = Translator(ckpt.model, ckpt.tokenizer)
    options = loading.decoding_options(ckpt.meta)
    src, tgt = checkpoint.directions(ckpt.meta)[0]
    sets = {
        "val": (read_lines(data / f"val.{src}.gz"), read_lines(data / f"val.{tgt}.gz")),
        "out-of-domain": ([s for s, _ in OUT_OF_DOMAIN], [r for _, r in OUT_OF_DOMAIN]),
    }
    rows = []
    for name, (sources, refs) in sets.items():
        for translation, ref in zip(translator.translate(sources, options), refs, strict=True):
            best = translation.hypotheses[0]
            chrf = sacrebleu.sentence_chrf(best.text, [ref]).score
            rows.append({"set": name, "confidence": best.confidence, "chrf": round(chrf, 2)})
    return rows


def plot(rows_file: Path, out: Path) -> dict[str, Any]:
    """Confidence against sentence chrF (``--confidence``'s rows) as a scatter with each set's
    mean chrF per confidence band -> the bands' figures (what docs/decoding.md tabulates)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    bands = [(0, 40), (40, 60), (60, 70), (70, 80), (80, 101)]
    figures: dict[str, Any] = {}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, colour in (("val", "tab:blue"), ("out-of-domain", "tab:red")):
        points = [(r["confidence"], r["chrf"]) for r in rows if r["set"] == name]
        xs, ys = zip(*points, strict=True)
        ax.scatter(xs, ys, s=8 if name == "val" else 30, alpha=0.35 if name == "val" else 0.9,
                   color=colour, label=f"{name} ({len(points)} sentences)")  # fmt: skip
        figures[name] = {}
        for low, high in bands:
            inside = [c for conf, c in points if low <= conf < high]
            if inside:
                figures[name][f"{low}-{min(high, 100)}"] = {
                    "sentences": len(inside),
                    "mean_chrf": round(sum(inside) / len(inside), 1),
                }
    ax.set_xlabel("confidence (details.confidence, 0-100)")
    ax.set_ylabel("sentence chrF against the reference")
    ax.set_title("en-de shipped model: confidence against quality")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, default=Path("weights"))
    parser.add_argument("--data-dir", type=Path, default=MULTI30K_DIR)
    parser.add_argument("--budget", type=float, default=0.1, help="val BLEU a candidate may cost")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per direction")
    parser.add_argument("--models", nargs="*", help="checkpoint folder names (default: all)")
    parser.add_argument(
        "--pairs", default="de-fr", help="a many-to-many model's directions to measure (comma-separated)"
    )
    parser.add_argument("--candidates", help="no_repeat_ngram_size values to try, strongest first (default: 4)")
    parser.add_argument("--confidence", type=Path, help="also write per-sentence confidence and chrF here (en-de)")
    parser.add_argument("--plot", type=Path, help="only draw --confidence's rows into this image (and print the bands)")
    args = parser.parse_args(argv)
    if args.plot:
        print(json.dumps(plot(args.confidence, args.plot)))
        return
    folders = sorted(p for p in args.weights.iterdir() if (p / checkpoint.CONFIG).is_file())
    with args.out.open("a") as out:
        for path in folders:
            if args.models and path.name not in args.models:
                continue
            served = checkpoint.directions(checkpoint.read_meta(path))
            pairs = [p for p in served if "-".join(p) in args.pairs.split(",")] if len(served) > 1 else served
            candidates = [(int(n), 1.0) for n in args.candidates.split(",")] if args.candidates else CANDIDATES
            for row in model_rows(path, pairs, args.budget, args.data_dir, candidates):
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
                out.flush()
                print(json.dumps(row, ensure_ascii=False), flush=True)
    if args.confidence:
        rows = confidence_rows(args.weights / "en-de", args.data_dir)
        args.confidence.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
