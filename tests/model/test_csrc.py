"""The fused kernels' C++ sources: the one translation unit the build compiles includes every file."""

from __future__ import annotations

import re

from model.engine import fused


def test_the_unity_file_includes_every_source_file_once() -> None:
    unity = fused.CSRC / fused.UNITY
    included = re.findall(r'^#include "([^"]+\.cpp)"$', unity.read_text(), re.M)
    others = sorted(p.name for p in fused.CSRC.glob("*.cpp") if p.name != fused.UNITY)
    assert sorted(included) == others and len(set(included)) == len(included)
