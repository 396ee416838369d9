"""Schema-driven fuzzing (schemathesis) of a real server: every operation in /openapi.json,
with requests generated from the schema, valid and invalid ones alike.

Whatever is generated, the server answers without a 5xx, every answer matches the status
codes, content types and bodies the schema declares, and valid requests (the schema states
the real limits: text length, list size, beam) are not rejected as invalid.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.helpers import running_server

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("fused_kernels")]

CHECKS = [
    schemathesis.checks.not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
    positive_data_acceptance,
]


LIMITS = {"TRANSLATOR_MAX_TEXT_CHARS": "300", "TRANSLATOR_MAX_ITEMS": "4", "TRANSLATOR_MAX_BEAM": "4",
          "TRANSLATOR_MAX_ALTERNATIVES": "2", "TRANSLATOR_CACHE_SIZE": "0",
          "TRANSLATOR_SUGGESTIONS": "true"}  # fmt: skip
OPERATIONS = [("POST", "/translate"), ("POST", "/attention"), ("POST", "/detect"), ("POST", "/suggest"),
              ("GET", "/languages"), ("GET", "/info"), ("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics"),
              ("GET", "/frontend/settings"), ("POST", "/translate_file"), ("GET", "/download_file/{name}")]  # fmt: skip


@pytest.fixture(scope="module")
def served(
    tiny_weights_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, schemathesis.BaseSchema]]:
    """A real server and the schema it publishes."""
    data = tmp_path_factory.mktemp("data")
    with running_server(
        {"TRANSLATOR_WEIGHTS_DIR": str(tiny_weights_dir), "TRANSLATOR_DATA_DIR": str(data), **LIMITS}
    ) as url:
        yield url, schemathesis.openapi.from_url(f"{url}/openapi.json")


def test_every_operation_is_fuzzed(served: tuple[str, schemathesis.BaseSchema]) -> None:
    paths = served[1].raw_schema["paths"]
    published = {(method.upper(), path) for path, ops in paths.items() for method in ops}
    assert published == set(OPERATIONS)


def test_the_schema_states_the_limits(served: tuple[str, schemathesis.BaseSchema]) -> None:
    body = served[1].raw_schema["paths"]["/translate"]["post"]["requestBody"]["content"]["application/json"]
    props = body["schema"]["properties"]
    assert props["source"]["enum"] == ["auto", "de"] and props["target"]["enum"] == ["en"]
    text, texts = props["q"]["anyOf"]
    assert text["maxLength"] == 300 and texts["maxItems"] == 4 and texts["items"]["maxLength"] == 300
    assert {"type": "integer", "minimum": 1, "maximum": 4} in props["beam_size"]["anyOf"]


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_operation_conforms_to_its_schema(served: tuple[str, schemathesis.BaseSchema], method: str, path: str) -> None:
    url, schema = served

    @given(case=schema[path][method].as_strategy())
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case: schemathesis.Case) -> None:
        # source "auto" is valid, yet a text in no served language gets 422 unsupported_language:
        # a rule about the text's content that no JSON schema can state. Every other check holds.
        auto = isinstance(case.body, dict) and case.body.get("source") == "auto"
        # a file's content must match its format (its name's extension): no schema can state it
        content = path == "/translate_file"
        checks = [c for c in CHECKS if not ((auto or content) and c is positive_data_acceptance)]
        case.call_and_validate(base_url=url, checks=checks, timeout=60)

    check()
