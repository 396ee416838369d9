"""Translation suggestions (LibreTranslate's ``POST /suggest``): users send a better translation,
the service keeps it for fine-tuning.

Off by default (``/suggest`` answers 403, as LibreTranslate does). With
``TRANSLATOR_SUGGESTIONS=true`` each suggestion is a row in an SQLite database
(``TRANSLATOR_DATA_DIR/suggestions.sqlite``, stdlib ``sqlite3``) in WAL mode, so concurrent
requests (and replicas sharing the folder on one host) append without blocking readers; each
write is its own short transaction with a busy timeout. ``translator suggestions export`` writes
them as a parallel corpus, one pair of files per direction, line i of one translating line i of
the other (model/training/data.py reads that layout).
"""

from __future__ import annotations

import argparse
import gzip
import logging
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

FILE = "suggestions.sqlite"
SCHEMA = """
CREATE TABLE IF NOT EXISTS suggestions (
    id INTEGER PRIMARY KEY,
    created REAL NOT NULL,
    source_lang TEXT NOT NULL,
    target_lang TEXT NOT NULL,
    source TEXT NOT NULL,
    suggestion TEXT NOT NULL
)
"""


class SuggestionStore:
    """Appends suggestions to the database in ``folder`` (created if missing)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / FILE
        self._local = threading.local()  # one connection per thread: sqlite3 objects are not shared
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=10.0)
            db.execute("PRAGMA busy_timeout=10000")
            self._local.db = db
        return db

    def add(self, source_lang: str, target_lang: str, source: str, suggestion: str) -> None:
        with self._connect() as db:  # one transaction, committed on leaving
            db.execute(
                "INSERT INTO suggestions (created, source_lang, target_lang, source, suggestion)"
                " VALUES (?, ?, ?, ?, ?)",
                (time.time(), source_lang, target_lang, source, suggestion),
            )

    def count(self) -> int:
        return int(self._connect().execute("SELECT COUNT(*) FROM suggestions").fetchone()[0])


def export(database: Path, out: Path) -> dict[str, int]:
    """Write ``out/suggestions.{src}-{tgt}.{src}.gz`` and ``....{tgt}.gz`` per direction (newlines
    inside a text become spaces, so lines stay parallel); -> pairs written per direction."""
    out.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
    rows = db.execute("SELECT source_lang, target_lang, source, suggestion FROM suggestions ORDER BY id").fetchall()
    db.close()
    by_direction: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for src, tgt, text, suggestion in rows:
        by_direction.setdefault((src, tgt), []).append((" ".join(text.split()), " ".join(suggestion.split())))
    written = {}
    for (src, tgt), pairs in sorted(by_direction.items()):
        stem = out / f"suggestions.{src}-{tgt}"
        for index, lang in ((0, src), (1, tgt)):
            with gzip.open(f"{stem}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.writelines(pair[index] + "\n" for pair in pairs)
        written[f"{src}-{tgt}"] = len(pairs)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="translator suggestions",
        description="Export the suggestions users sent (POST /suggest) as a parallel corpus for fine-tuning.",
    )
    parser.add_argument("action", choices=["export"])
    parser.add_argument("--data-dir", type=Path, default=Path("data"), help="TRANSLATOR_DATA_DIR of the server")
    parser.add_argument("--out", type=Path, required=True, help="folder for the corpus files")
    args = parser.parse_args(argv)
    database = args.data_dir / FILE
    if not database.is_file():
        log.error("no suggestions database at %s", database)
        return 2
    for direction, pairs in export(database, args.out).items():
        print(f"{direction}: {pairs} pairs")
    return 0
