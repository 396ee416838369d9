"""Serving precisions: int8 served for real, and settings this machine cannot run refused at start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.serving.service import assign_directions, discover
from model.engine import kernels
from model.engine.features import detected
from tests.helpers import ROOT, free_port, running_server

pytestmark = [pytest.mark.server, pytest.mark.isa, pytest.mark.usefixtures("fused_kernels")]

DOC = {"source": "de", "target": "en"}


def _serve_and_exit(env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "TRANSLATOR_HOST": "127.0.0.1", "TRANSLATOR_PORT": str(free_port()), **env}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "serve"], cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.skipif(not detected().avx2, reason="int8 needs AVX2; its refusal is tested below")
def test_int8_is_served_and_reported(shipped: Path) -> None:
    env = {"TRANSLATOR_WEIGHTS_DIR": str(shipped.parent), "TRANSLATOR_DTYPE": "int8", "TRANSLATOR_THREADS": "2"}
    with running_server(env) as url:
        reply = httpx.post(f"{url}/translate", json={"q": "Zwei Hunde spielen im Schnee.", **DOC}, timeout=60)
        assert reply.status_code == 200 and "dogs" in reply.json()["translatedText"].lower()
        infos = httpx.get(f"{url}/info").json()["directions"]
        assert {(i["dtype"], i["kernel"], i["step_kernel"]) for i in infos} == {("int8", "fbgemm-int8", "fbgemm-int8")}
        # the K/V cache in float16 where the fused kernels run and convert with F16C (kernels.kv_cache_dtype)
        half = kernels.choose("cpu", "int8").kv_dtype is not None and all(i["fused_step"] for i in infos)
        assert {i["kv_cache"] for i in infos} == {"float16" if half else "float32"}
        # the products on the fused kernels' own int8 product where they run (every row count on AVX2)
        expected_products = {kernels.int8_products("int8", i["fused_step"]) for i in infos}
        assert {i["int8_products"] for i in infos} == expected_products
        if all(i["fused_step"] == "avx2" for i in infos):
            assert expected_products == {"fused kernels (every row count)"}
        plan = assign_directions(discover(shipped.parent))  # the many-to-many model serves eight of them
        # int8 scores the whole vocabulary, shortlist shipped or not (its own output projection is faster)
        vocabulary = {f"{s}-{t}": "full" for pairs in plan.values() for s, t in pairs or []}
        shipped_directions = sorted(vocabulary)
        assert len(shipped_directions) == 12 and (shipped / "shortlist.safetensors").is_file()
        assert sorted(f"{i['source']}-{i['target']}" for i in infos) == shipped_directions
        assert {f"{i['source']}-{i['target']}": i["vocabulary"] for i in infos} == vocabulary
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
        labels = sorted((s.labels for s in families["translator_model_info"].samples), key=lambda x: x["direction"])
        expected = [
            {"direction": d, "device": "cpu", "dtype": "int8", "vocabulary": vocabulary[d]} for d in shipped_directions
        ]
        assert labels == expected


@pytest.mark.parametrize(
    ("env", "message"),
    [
        # a CPU without AVX2, as the libraries' ISA cap presents it: fbgemm cannot run
        ({"TRANSLATOR_DTYPE": "int8", "ONEDNN_MAX_CPU_ISA": "SSE41", "ATEN_CPU_CAPABILITY": "default"}, "AVX2"),
        ({"TRANSLATOR_WEIGHTS_DIR": "/nonexistent/weights"}, "weights folder"),
        ({"TRANSLATOR_LOAD_ONLY": "xx,yy"}, "TRANSLATOR_LOAD_ONLY=xx,yy: no checkpoint"),
    ],
)
def test_settings_that_cannot_run_fail_start_up(shipped: Path, env: dict[str, str], message: str) -> None:
    proc = _serve_and_exit({"TRANSLATOR_WEIGHTS_DIR": str(shipped.parent), **env})
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
    assert "TRANSLATOR_" in proc.stdout + proc.stderr or message == "weights folder"


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="this machine has a GPU: TRANSLATOR_DEVICE=cuda is valid"
)
def test_cuda_without_a_gpu_fails_start_up(shipped: Path) -> None:
    proc = _serve_and_exit({"TRANSLATOR_WEIGHTS_DIR": str(shipped.parent), "TRANSLATOR_DEVICE": "cuda"})
    assert proc.returncode != 0 and "TRANSLATOR_DEVICE=cuda" in proc.stdout + proc.stderr
