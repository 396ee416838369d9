"""The names of the precisions the engine runs (``TRANSLATOR_DTYPE``, ``--dtype``), in one place
that imports no torch, so the settings and the command line can list them cheaply.
``model.engine.kernels`` decides how each runs on this machine."""

from __future__ import annotations

import typing
from typing import Literal

Precision = Literal["float32", "bfloat16", "float16", "int8"]
PRECISIONS: tuple[Precision, ...] = typing.get_args(Precision)


def resolve_precision(name: Precision | Literal["auto"], device_type: str) -> Precision:
    """A precision setting -> the precision to run ("auto": float16 on CUDA, float32 elsewhere)."""
    if name == "auto":
        return "float16" if device_type == "cuda" else "float32"
    return name
