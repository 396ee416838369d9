"""A short memory soak of the real server with the shipped model (the long one is ``python -m bench.soak``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, free_port

pytestmark = pytest.mark.usefixtures("fused_kernels")


@pytest.mark.slow
@pytest.mark.server
def test_a_short_soak_of_the_real_server_stays_flat(data_dir: Path) -> None:
    """600 distinct requests (1-4 sentences, beams 1, 2, 4 and 8 in turn, translation cache on)
    from 8 clients: after 200 of warm-up, the RSS the server keeps when idle grows by at most
    15%, and under load it stays within 2x its RSS at ready (docs/reliability.md "Memory", where
    the figures with and without the row buckets and bounded oneDNN caches are)."""
    cmd = [sys.executable, "-m", "bench.soak", "--requests", "600", "--warmup", "200", "--concurrency", "8"]
    cmd += ["--sample-every", "100", "--cache", "on", "--port", str(free_port()), "--data", str(data_dir)]
    cmd += ["--env", "TRANSLATOR_REQUEST_TIMEOUT_S=600"]  # a loaded CI machine must not time requests out
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    summary = lines[-1]
    assert summary["requests"] == 600 and len(lines) >= 6, lines  # ready, warm-up and 4 samples
    assert summary["growth_idle"] <= 0.15, summary
    assert summary["peak_over_ready"] <= 2.0, summary
