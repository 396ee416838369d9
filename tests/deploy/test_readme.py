"""The deployment docs: the settings table, the API examples, the scaling-out compose file.

README.md links to them: docs/deploy.md (settings, Docker, scaling out) and docs/api.md (examples).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.http.openapi import RequestModels
from app.http.routes import build_router
from tests.deploy import settings_table
from tests.deploy.readme import DEPLOY, api_commands, block_after, readme, section, table_rows
from tests.deploy.tools import compose_config, find_tool
from tests.helpers import ROOT

BASE = ROOT / "docker-compose.yml"
ROUTER = build_router(RequestModels())  # every route, with the request models as written
PAGES = {"/", "/viewer"}  # the HTML pages (tests/e2e: in a browser), no API to show with curl


def test_configuration_table_lists_exactly_the_settings_fields() -> None:
    assert "\n## Configuration\n" in readme(DEPLOY)
    documented = [r["variable"] for r in table_rows()]
    expected = [r.variable for r in settings_table.rows()]
    assert documented == expected, "regenerate with: python -m tests.deploy.settings_table"


def test_configuration_table_defaults_and_meanings_match_the_code() -> None:
    for row, expected in zip(table_rows(), settings_table.rows(), strict=True):
        assert row["default"] == expected.default, row["variable"]
        assert expected.meaning in row["meaning"], f"{row['variable']}: docs/deploy.md says {row['meaning']!r}"


@pytest.mark.parametrize("path", sorted({r.path for r in ROUTER.routes if r.path not in PAGES}))  # type: ignore[attr-defined]
def test_api_examples_cover_every_endpoint(path: str) -> None:
    assert re.search(rf"curl -s localhost:8000{re.escape(path)}[\s'|]", api_commands() + "\n"), path


@pytest.mark.parametrize(
    "feature",
    ['"q": ["', '"alternatives": 2', '"details": true', "--data-urlencode 'q=", "X-API-Key", "/attention"],
)
def test_api_examples_show_each_request_form(feature: str) -> None:
    assert feature in api_commands()


@pytest.fixture(scope="module")
def scale_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("scale") / "docker-compose.scale.yml"
    path.write_text(block_after("<!-- scale-compose -->", "yaml", DEPLOY) + "\n")
    return path


@pytest.fixture(scope="module")
def scaled(scale_file: Path) -> dict[str, Any]:
    done = compose_config(BASE, scale_file)
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = yaml.safe_load(done.stdout)
    return data


@pytest.mark.external
def test_scale_example_is_valid_compose_with_replicas_behind_a_balancer(scaled: dict[str, Any]) -> None:
    translator, balancer = scaled["services"]["translator"], scaled["services"]["balancer"]
    assert translator["deploy"]["replicas"] == 3
    assert not translator.get("ports"), "replicas must not all publish the same host port"
    assert balancer["ports"][0]["target"] == 8000 and balancer["restart"] == "unless-stopped"


def haproxy_config(scaled: dict[str, Any]) -> str:
    content: str = scaled["configs"]["haproxy"]["content"]
    return content


@pytest.mark.external
def test_balancer_checks_ready_not_health(scaled: dict[str, Any]) -> None:
    config = haproxy_config(scaled)
    assert "http-check send meth GET uri /ready" in config and "/health" not in config
    assert "server-template translator" in config and "translator:8000" in config


@pytest.mark.external
def test_balancer_config_passes_haproxy_check(scaled: dict[str, Any], tmp_path: Path) -> None:
    haproxy = find_tool("haproxy", "apt-get install haproxy")
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config(scaled))
    done = subprocess.run([haproxy, "-c", "-f", config], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_docker_section_names_real_files() -> None:
    docker = section("Docker", DEPLOY)
    for name in ("docker-compose.gpu.yml", "VARIANT=cpu", "/app/weights", "docker-compose.override.yml"):
        assert name in docker
    assert (ROOT / "docker-compose.gpu.yml").is_file()
