"""Progress bars of the commands (training, validation, evaluation, benchmarks).

tqdm on stderr, and only when stderr is a terminal (tqdm's ``disable=None``): piped into a file
or run by CI, a command prints its results and logs and nothing else. Library code never draws
bars; it takes a callback (``Translator.translate(on_done=...)``) that a command connects here.
"""

from __future__ import annotations

from tqdm import tqdm


def progress(total: int | None, desc: str, unit: str = "sentence") -> tqdm:
    """A bar that counts to ``total`` (None: unknown), gone when it closes."""
    return tqdm(total=total, desc=desc, unit=unit, disable=None, leave=False, mininterval=1.0, dynamic_ncols=True)
