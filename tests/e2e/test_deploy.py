"""The monitoring stack for real: the service, a real Prometheus with deploy/prometheus.yml, the dashboard.

Prometheus is Debian's ``prometheus`` package (``/usr/bin/prometheus``, or ``PROMETHEUS_BIN``). Its
configuration is deploy/prometheus.yml with only the targets moved to loopback (the compose DNS
name ``translator`` becomes the test server's address) and the scrape interval shortened. Without
the program the Prometheus tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import copy
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy import dashboard
from tests.helpers import ROOT, SHIPPED, free_port, require, running_server, stop

PROMETHEUS_YML = ROOT / "deploy" / "prometheus.yml"
PROMETHEUS_BIN = Path(os.environ.get("PROMETHEUS_BIN", "/usr/bin/prometheus"))
SCRAPE_INTERVAL = "1s"
TARGET_LABELS = {"instance", "job"}  # added by Prometheus at scrape time
TEXTS = ["Ein Mann fährt mit dem Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch."]

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.external, pytest.mark.usefixtures("fused_kernels")]


@pytest.fixture(scope="module")
def server(tiny_weights_dir: Path) -> Iterator[str]:
    weights = SHIPPED.parent if SHIPPED.is_dir() else tiny_weights_dir
    with running_server({"TRANSLATOR_WEIGHTS_DIR": str(weights), "TRANSLATOR_THREADS": "1"}) as url:
        drive_traffic(url)
        yield url


def drive_traffic(url: str) -> None:
    """Successful translations (single, list, with details), a cache hit, and client errors."""
    with httpx.Client(base_url=url, timeout=60) as client:
        for text in TEXTS:
            assert client.post("/translate", json={"q": text, "source": "de", "target": "en"}).status_code == 200
        body = {"q": TEXTS, "source": "de", "target": "en", "details": True}
        assert client.post("/translate", json=body).status_code == 200
        assert client.post("/translate", json={"q": "", "source": "de", "target": "en"}).status_code == 400
        assert client.post("/translate", json={"q": "x", "source": "xx", "target": "en"}).status_code == 400
        assert client.post("/attention", json={"q": TEXTS[0], "source": "de", "target": "en"}).status_code == 200
        for path in ("/languages", "/info", "/health", "/ready"):
            assert client.get(path).status_code == 200


def scrape_config(service: str, prometheus: str) -> dict[str, Any]:
    """deploy/prometheus.yml with the targets on loopback and a short scrape interval, nothing else."""
    config: dict[str, Any] = yaml.safe_load(PROMETHEUS_YML.read_text())
    config = copy.deepcopy(config)
    config["global"]["scrape_interval"] = SCRAPE_INTERVAL
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    translator = jobs["translator"]
    (sd,) = translator.pop("dns_sd_configs")
    assert sd["names"] == ["translator"] and sd["port"] == 8000, "the compose service name and port"
    translator["static_configs"] = [{"targets": [service]}]
    translator["scrape_interval"] = SCRAPE_INTERVAL
    jobs["prometheus"]["static_configs"] = [{"targets": [prometheus]}]
    return config


@pytest.fixture(scope="module")
def prometheus(server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require(PROMETHEUS_BIN.is_file(), f"no Prometheus at {PROMETHEUS_BIN} (apt-get install prometheus)")
    folder = tmp_path_factory.mktemp("prometheus")
    address = f"127.0.0.1:{free_port()}"
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(server.removeprefix("http://"), address)))
    command = [
        str(PROMETHEUS_BIN),
        f"--config.file={config}",
        f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address={address}",
    ]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://{address}"
        try:
            wait_for(lambda: probe(f"{url}/-/ready"), 30, "Prometheus ready", proc, log)
            yield url
        finally:
            stop(proc)


def probe(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def wait_for(
    check: Any, timeout: float, what: str, proc: subprocess.Popen[bytes] | None = None, log: Any = None
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"exited with {proc.returncode} before {what}:\n{log.read()[-3000:]}")
        if result := check():
            return result
        time.sleep(0.5)
    raise TimeoutError(f"no {what} after {timeout} s")


def query(prometheus: str, promql: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=10)
    assert response.status_code == 200, f"{promql}: {response.text}"
    data = response.json()
    assert data["status"] == "success", data
    result: list[dict[str, Any]] = data["data"]["result"]
    return result


def positive(prometheus: str, promql: str) -> bool:
    return any(float(r["value"][1]) > 0 for r in query(prometheus, promql))


@pytest.fixture(scope="module")
def scraped(prometheus: str) -> str:
    """Prometheus once it holds two scrapes after the traffic (so rate() has a range to work on):
    two samples of one series (the server has a series per direction, all in every scrape)."""
    counted = 'max(count_over_time(translator_source_tokens_total{job="translator"}[1m]))'
    wait_for(lambda: any(float(r["value"][1]) >= 2 for r in query(prometheus, counted)), 45, "translator_ scrapes")
    return prometheus


def test_prometheus_scrapes_the_translator_target(scraped: str) -> None:
    targets = httpx.get(f"{scraped}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    health = {t["labels"]["job"]: t["health"] for t in targets}
    assert health == {"translator": "up", "prometheus": "up"}, targets


@pytest.mark.parametrize(
    "promql",
    [
        'translator_requests_total{endpoint="/translate", status="200"}',
        'translator_requests_total{endpoint="/translate", status="400"}',
        'translator_request_duration_seconds_count{endpoint="/translate"}',
        "translator_queue_wait_seconds_count",
        "translator_batch_sentences_sum",
        "translator_batch_tokens_sum",
        'translator_source_tokens_total{direction="de-en"}',
        'translator_target_tokens_total{direction="de-en"}',
        'translator_decode_steps_total{direction="de-en"}',
        "translator_cache_hits_total",
        "translator_cache_misses_total",
        'translator_model_info{direction="de-en"}',
        'process_resident_memory_bytes{job="translator"}',
    ],
)
def test_translator_series_are_scraped_with_values(scraped: str, promql: str) -> None:
    assert positive(scraped, promql), f"{promql}: {query(scraped, promql)}"


def test_every_dashboard_query_runs_on_prometheus_and_returns_data(scraped: str) -> None:
    """Valid PromQL for a real Prometheus, and not an empty panel after the traffic above."""
    empty = [q for q in dashboard.queries(dashboard.load()) if not q.panel.startswith("variable")]
    empty = [q for q in empty if not query(scraped, dashboard.concrete(q.expr))]
    assert not empty, f"panels without data: {[(q.panel, q.expr) for q in empty]}"


def live_series(url: str) -> dict[str, set[str]]:
    """Exposed sample name (with its _bucket/_sum/_count/_total suffix) -> its label names."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def test_every_dashboard_metric_is_exported_by_the_service(server: str) -> None:
    series = live_series(server)
    for q in dashboard.queries(dashboard.load()):
        names = dashboard.metric_names(q.expr)
        assert names, f"{q.panel}: no metric found in {q.expr}"
        missing = names - series.keys()
        assert not missing, f"{q.panel}: {sorted(missing)} not in /metrics ({q.expr})"
        for name, labels in dashboard.label_matchers(q.expr).items():
            unknown = labels - series[name] - TARGET_LABELS
            assert not unknown, f"{q.panel}: {name} has no label {sorted(unknown)}"


def test_the_dashboard_covers_the_service_metric_families(server: str) -> None:
    used = {name for q in dashboard.queries(dashboard.load()) for name in dashboard.metric_names(q.expr)}
    families = {
        name.removesuffix(suffix)
        for name in used
        for suffix in ("_bucket", "_sum", "_count", "_total")
        if name.endswith(suffix)
    }
    families |= used
    exported = {f.name for f in text_string_to_metric_families(httpx.get(f"{server}/metrics", timeout=10).text)}
    translator = {name for name in exported if name.startswith("translator_")}
    assert translator <= families, f"not on the dashboard: {sorted(translator - families)}"
