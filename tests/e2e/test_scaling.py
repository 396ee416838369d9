"""docs/deploy.md's scaling-out balancer for real: HAProxy with its configuration, in front of real replicas.

The HAProxy configuration is the one in docs/deploy.md's compose example, with only the addresses moved to
loopback (compose's DNS service discovery becomes a static list of the test's replicas) and a stats
page added so the test can see which replicas HAProxy counts as up. Two replicas are ready; a third
answers /health but never becomes ready (its weights folder is empty): the balancer's /ready check
must keep every request away from it. Needs Debian's ``haproxy`` (skip without it, fail in CI).
"""

from __future__ import annotations

import csv
import io
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.readme import DEPLOY, block_after
from tests.deploy.tools import compose_config, find_tool
from tests.helpers import ROOT, SHIPPED, free_port, running_server, stop

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.external, pytest.mark.usefixtures("fused_kernels")]


@dataclass(frozen=True)
class Cluster:
    balancer: str
    stats: str
    ready: list[str]
    not_ready: str


def readme_haproxy_config(tmp: Path) -> str:
    """The HAProxy configuration of docs/deploy.md's scaling example, as Compose resolves it."""
    scale = tmp / "docker-compose.scale.yml"
    scale.write_text(block_after("<!-- scale-compose -->", "yaml", DEPLOY) + "\n")
    done = compose_config(ROOT / "docker-compose.yml", scale)
    assert done.returncode == 0, done.stderr
    content: str = yaml.safe_load(done.stdout)["configs"]["haproxy"]["content"]
    return content


def on_loopback(config: str, bind: int, servers: list[str], stats: int) -> str:
    """Drop the DNS resolver section, list the servers statically, bind to loopback, add stats."""
    out: list[str] = []
    skipping = False
    for line in config.splitlines():
        if line and not line[0].isspace():
            skipping = line.startswith("resolvers ")
        if skipping:
            continue
        stripped = line.strip()
        if stripped.startswith("bind "):
            line = line.replace(stripped, f"bind 127.0.0.1:{bind}")
        elif stripped.startswith("default-server "):
            line = re.sub(r"\s+resolvers \S+", "", line)
        elif stripped.startswith("server-template "):
            indent = line[: len(line) - len(line.lstrip())]
            out += [f"{indent}server r{i} {address}" for i, address in enumerate(servers)]
            continue
        out.append(line)
    out += ["frontend stats", f"  bind 127.0.0.1:{stats}", "  stats enable", "  stats uri /stats"]
    return "\n".join(out) + "\n"


@contextmanager
def process(command: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A child process with its output in a temporary file; stopped on exit."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            stop(proc)


def never_ready_replica(stack: ExitStack, folder: Path) -> str:
    """A replica whose checkpoint fails to load: it answers, /ready 503 for ever (and /health
    503, so an orchestrator would restart it; an empty weights folder fails start-up instead)."""
    empty = folder / "broken-weights"
    (empty / "de-en").mkdir(parents=True)
    (empty / "de-en" / "config.json").write_text("{corrupt")
    port = free_port()
    env = {
        **os.environ,
        "TRANSLATOR_HOST": "127.0.0.1",
        "TRANSLATOR_PORT": str(port),
        "TRANSLATOR_WEIGHTS_DIR": str(empty),
    }
    stack.enter_context(process([sys.executable, "-m", "app.cli", "serve"], env))
    url = f"http://127.0.0.1:{port}"
    wait(lambda: status(f"{url}/health") == 503, 60, "the never-ready replica's /health")
    assert status(f"{url}/ready") == 503
    return url


def status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return 0


def wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.3)
    raise TimeoutError(f"{what}: not reached after {timeout} s")


def start_haproxy(stack: ExitStack, folder: Path, servers: list[str]) -> tuple[str, str]:
    haproxy = find_tool("haproxy", "apt-get install haproxy")
    bind, stats = free_port(), free_port()
    config = folder / "haproxy.cfg"
    config.write_text(on_loopback(readme_haproxy_config(folder), bind, servers, stats))
    stack.enter_context(process([str(haproxy), "-db", "-f", str(config)]))
    stats_url = f"http://127.0.0.1:{stats}/stats"
    wait(lambda: status(stats_url) == 200, 30, "HAProxy's stats page")
    return f"http://127.0.0.1:{bind}", stats_url


def server_states(stats_url: str) -> dict[str, str]:
    """HAProxy's view of the backend: server name -> UP / DOWN / ..."""
    text = httpx.get(f"{stats_url};csv", timeout=5).text.lstrip("# ")
    rows = csv.DictReader(io.StringIO(text))
    return {r["svname"]: r["status"] for r in rows if r["pxname"] == "translators" and r["svname"] != "BACKEND"}


@pytest.fixture(scope="module")
def cluster(tiny_weights_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("scaling")
    weights = SHIPPED.parent if SHIPPED.is_dir() else tiny_weights_dir
    env = {"TRANSLATOR_WEIGHTS_DIR": str(weights), "TRANSLATOR_THREADS": "1"}
    with ExitStack() as stack:
        ready = [stack.enter_context(running_server(env)) for _ in range(2)]
        not_ready = never_ready_replica(stack, folder)
        servers = [u.removeprefix("http://") for u in [*ready, not_ready]]
        balancer, stats = start_haproxy(stack, folder, servers)
        expected = {"r0": "UP", "r1": "UP", "r2": "DOWN"}
        wait(lambda: server_states(stats) == expected, 30, f"HAProxy states {expected}")
        yield Cluster(balancer, stats, ready, not_ready)


def translate_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    match = re.search(r'^translator_requests_total\{endpoint="/translate",status="200"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_balancer_spreads_requests_over_ready_replicas_only(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.balancer, timeout=60) as client:
        for i in range(20):
            body = {"q": f"Ein Hund Nummer {i} rennt.", "source": "de", "target": "en"}
            response = client.post("/translate", json=body)
            assert response.status_code == 200, response.text
    counts = [translate_requests(url) for url in cluster.ready]
    assert sum(counts) == 20 and all(c > 0 for c in counts), counts
    assert translate_requests(cluster.not_ready) == 0


def test_balancer_counts_the_not_ready_replica_as_down(cluster: Cluster) -> None:
    assert server_states(cluster.stats)["r2"] == "DOWN"
    assert status(f"{cluster.balancer}/ready") == 200
