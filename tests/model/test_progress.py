"""Progress bars: drawn on a terminal, silent when the output goes to a pipe or a file (CI)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

from model.engine.options import DecodingOptions
from model.engine.translator import Translator
from model.network.tokenizer import Tokenizer
from tests.factories import random_model
from tests.helpers import ROOT

SNIPPET = (
    "from model.training.progress import progress\n"
    "with progress(3, 'validation BLEU') as bar:\n"
    "    for _ in range(3): bar.update()\n"
    "print('result line')\n"
)


def test_a_bar_is_drawn_on_a_terminal() -> None:
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    proc = subprocess.Popen([sys.executable, "-c", SNIPPET], cwd=ROOT, stdout=follower, stderr=follower)
    os.close(follower)
    proc.wait(60)
    out = b""
    try:
        while chunk := os.read(leader, 4096):
            out += chunk
    except OSError:  # the terminal closed with the process
        pass
    text = out.decode(errors="replace")
    assert "validation BLEU" in text and "0/3" in text and "result line" in text  # (cleared on close)


def test_nothing_but_results_when_not_on_a_terminal() -> None:
    done = subprocess.run([sys.executable, "-c", SNIPPET], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout == "result line\n"
    assert done.stderr == ""


def test_translate_reports_every_sentence_done_once(tiny_tokenizer: Tokenizer) -> None:
    translator = Translator(random_model(tiny_tokenizer.vocab_size), tiny_tokenizer)
    texts = [f"Ein Mann mit {n} Hunden." for n in range(11)]
    counts: list[int] = []
    out = translator.translate(texts, DecodingOptions(beam_size=1), max_batch_tokens=40, on_done=counts.append)
    assert len(out) == 11 and sum(counts) == 11 and len(counts) > 1  # several batches
