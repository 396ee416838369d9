"""Logs and traces of a real server process: JSON log lines with request ids and extra fields,
and OpenTelemetry spans exported over OTLP/HTTP to a receiver the test runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from app.settings import Settings
from tests.factories import assert_error, start
from tests.helpers import ROOT, free_port, running_server, wait_ready

DOC = {"source": "de", "target": "en", "beam_size": 1}


class Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: keeps every span it is sent."""

    spans: ClassVar[list[Any]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                Receiver.spans.extend(scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def receiver() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.mark.server
@pytest.mark.usefixtures("fused_kernels")
def test_spans_of_a_request_reach_an_otlp_receiver(tiny_weights_dir: Path, receiver: str) -> None:
    """One root span a request with a child per phase: FastAPI's own instrumentation is off, so
    it adds no second root span even where it would configure itself from the environment."""
    env = {
        "TRANSLATOR_WEIGHTS_DIR": str(tiny_weights_dir),
        "FASTAPI_OTEL_AUTO_CONFIGURE": "true",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s
        "OTEL_SERVICE_NAME": "translator-test",
    }
    with running_server(env) as url:
        Receiver.spans.clear()
        response = httpx.post(f"{url}/translate", json={"q": "Ein Hund.", **DOC}, headers={"x-request-id": "trace-1"})
        assert response.status_code == 200
        for _ in range(100):
            if any(s.name == "POST /translate" for s in Receiver.spans):
                break
            threading.Event().wait(0.05)
        threading.Event().wait(0.3)  # (three export periods for any later span)
    roots = [s for s in Receiver.spans if s.name == "POST /translate"]
    assert len(roots) == 1, [s.name for s in Receiver.spans]
    assert not [s.name for s in Receiver.spans if s.name.startswith("fastapi")]
    root = roots[0]
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["translator.request_id"].string_value == "trace-1"
    assert attributes["http.response.status_code"].int_value == 200
    children = {s.name: s for s in Receiver.spans if s.parent_span_id == root.span_id}
    assert {"parse", "prepare", "queue", "encode", "decode", "detokenize"} <= set(children)
    for child in children.values():  # inside the request, in time
        assert root.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
        assert child.end_time_unix_nano <= root.end_time_unix_nano
    order = ["parse", "prepare", "queue", "encode", "decode", "detokenize"]
    starts = [children[name].start_time_unix_nano for name in order]
    assert starts == sorted(starts)  # the phases follow one another


@pytest.mark.server
@pytest.mark.usefixtures("fused_kernels")
def test_the_server_logs_json_lines_with_request_ids_and_extra_fields(tiny_weights_dir: Path) -> None:
    port = free_port()
    env = {
        "TRANSLATOR_WEIGHTS_DIR": str(tiny_weights_dir),
        "TRANSLATOR_PORT": str(port),
        "TRANSLATOR_HOST": "127.0.0.1",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve"],
        cwd=ROOT,
        env={**os.environ, **env, "TRANSLATOR_HOST": "127.0.0.1"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, 120)  # type: ignore[arg-type]
        httpx.post(
            f"http://127.0.0.1:{port}/translate", json={"q": "Ein Hund.", **DOC}, headers={"x-request-id": "r-7"}
        )
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert records and len(records) == len(err.splitlines()), err[-2000:]  # every line is JSON
    access = [r for r in records if r["logger"] == "app.access" and r["request_id"] == "r-7"]
    assert len(access) == 1
    assert access[0]["status"] == 200 and access[0]["duration_ms"] > 0 and access[0]["level"] == "INFO"
    assert {"ts", "level", "logger", "message", "request_id"} <= set(records[0])


@pytest.mark.slow
def test_every_command_logs_json(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "plot", "training", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 2
    record = json.loads(done.stderr.strip().splitlines()[-1])
    assert record["level"] == "ERROR" and record["logger"] == "model.training.plot" and "log.jsonl" in record["message"]
    text = subprocess.run(
        [sys.executable, "-m", "app.cli", "plot", "training", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "TRANSLATOR_LOG_FORMAT": "text"},
    )
    assert " ERROR model.training.plot [-]: " in text.stderr


def test_every_error_body_names_its_request(tiny_weights_dir: Path) -> None:
    for client in start(Settings(weights_dir=tiny_weights_dir, max_body_bytes=2048)):
        cases = [
            client.post("/translate", json={"q": "", **DOC}, headers={"x-request-id": "e-1"}),  # 400 from the route
            client.post("/translate", content=b"{", headers={"x-request-id": "e-2"}),  # 400 invalid JSON
            client.post("/translate", content=b"x" * 4096, headers={"x-request-id": "e-3"}),  # 413 in the middleware
            client.get("/nowhere", headers={"x-request-id": "e-4"}),  # 404 from the router
        ]
        for i, response in enumerate(cases, 1):
            body = assert_error(response, response.status_code)
            assert response.status_code >= 400 and body["request_id"] == f"e-{i}" == response.headers["x-request-id"]


def test_metrics_negotiate_openmetrics_and_gzip(tiny_weights_dir: Path) -> None:
    """/metrics is prometheus-client's own exposition: text by default, OpenMetrics when the
    scraper asks (Prometheus does), gzip when accepted."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
    from prometheus_client.parser import text_string_to_metric_families

    for client in start(Settings(weights_dir=tiny_weights_dir)):
        plain = client.get("/metrics", headers={"accept-encoding": "identity"})
        assert plain.headers["content-type"].startswith("text/plain")
        assert any(f.name == "translator_queue_depth" for f in text_string_to_metric_families(plain.text))
        om = client.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
        assert om.headers["content-type"].startswith("application/openmetrics-text") and om.text.endswith("# EOF\n")
        assert any(f.name == "translator_queue_depth" for f in openmetrics_families(om.text))
        raw = client.get("/metrics", headers={"accept-encoding": "gzip"})
        assert raw.headers["content-encoding"] == "gzip"  # (httpx has already decoded the body)
        assert "translator_queue_depth" in raw.text


def test_a_labelled_series_is_looked_up_once_and_exported_as_labels_gives_it() -> None:
    from prometheus_client import generate_latest

    from app.observability.metrics import Metrics

    m = Metrics()
    series = m.series(m.request_phase, "/translate", "decode")
    assert series is m.series(m.request_phase, "/translate", "decode") is m.request_phase.labels("/translate", "decode")
    assert m.series(m.request_phase, "/translate", "queue") is not series
    series.observe(0.02)
    m.series(m.requests, "/translate", "200").inc(3)
    text = generate_latest(m.registry).decode()
    assert 'translator_request_phase_seconds_count{endpoint="/translate",phase="decode"} 1.0' in text
    assert 'translator_requests_total{endpoint="/translate",status="200"} 3.0' in text
