"""/attention: shapes match tokens, rows sum to 1, filters, word level, alignment, limits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.settings import Settings
from tests.factories import DOC, assert_error, server_timing, start

TEXT = "Ein kleines Mädchen klettert in ein Spielhaus aus Holz."


@pytest.fixture(scope="module")
def client(tiny_weights_dir: Path) -> Iterator[TestClient]:
    yield from start(Settings(weights_dir=tiny_weights_dir, attention_max_tokens=40, attention_max_cells=20000))


def attention(client: TestClient, **extra: Any) -> dict[str, Any]:
    response = client.post("/attention", json={"q": TEXT, **DOC, **extra})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_shapes_match_tokens_and_rows_sum_to_one(client: TestClient) -> None:
    out = attention(client)
    src, tgt, tgt_in = out["source_tokens"], out["target_tokens"], out["target_input_tokens"]
    assert src[-1] == "</s>" and tgt[-1] == "</s>" and tgt_in[0] == "<s>" and len(tgt_in) == len(tgt)
    layers, heads = out["n_layers"], out["n_heads"]
    expected = {
        "cross": (layers, heads, len(tgt), len(src)),
        "encoder": (out["n_encoder_layers"], heads, len(src), len(src)),
        "decoder": (layers, heads, len(tgt), len(tgt_in)),
    }
    for kind, shape in expected.items():
        maps = np.array(out["attention"][kind])
        assert maps.shape == shape
        np.testing.assert_allclose(maps.sum(-1), 1.0, atol=2e-3)  # values are rounded to 4 decimals
        assert (maps >= 0).all()
    decoder = np.array(out["attention"]["decoder"])
    assert np.triu(decoder, k=1).max() == 0  # causal
    assert out["translatedText"] == client.post("/translate", json={"q": TEXT, **DOC}).json()["translatedText"]


def test_server_timing_names_the_maps_pass(client: TestClient) -> None:
    response = client.post("/attention", json={"q": TEXT, **DOC, "kinds": ["cross"]})
    timings = server_timing(response)
    assert list(timings) == ["parse", "prepare", "queue", "encode", "decode", "handoff", "maps", "respond", "total"]
    assert timings["maps"] > 0 and sum(v for k, v in timings.items() if k != "total") <= timings["total"] + 0.1


def test_filters_select_layers_heads_and_kinds(client: TestClient) -> None:
    full = attention(client)
    part = attention(client, layers=[1], heads=[3, 0], kinds=["cross"])
    assert set(part["attention"]) == {"cross"} and part["layers"] == [1] and part["heads"] == [3, 0]
    cross_full, cross_part = np.array(full["attention"]["cross"]), np.array(part["attention"]["cross"])
    np.testing.assert_array_equal(cross_part[0, 0], cross_full[1, 3])
    np.testing.assert_array_equal(cross_part[0, 1], cross_full[1, 0])


def test_word_level_merges_pieces(client: TestClient) -> None:
    sub = attention(client)
    word = attention(client, level="word")
    assert len(word["source_tokens"]) <= len(sub["source_tokens"])
    assert "Spielhaus" in word["source_tokens"] and "</s>" in word["source_tokens"]
    assert not any(t.startswith("▁") for t in word["source_tokens"])
    maps = np.array(word["attention"]["cross"])
    assert maps.shape[-2:] == (len(word["target_tokens"]), len(word["source_tokens"]))
    np.testing.assert_allclose(maps.sum(-1), 1.0, atol=2e-3)


def test_alignment_points_at_real_tokens(client: TestClient) -> None:
    out = attention(client, heads=[0, 1])
    src, tgt = out["source_tokens"], out["target_tokens"]
    cross = np.array(out["attention"]["cross"]).mean(axis=(0, 1))
    assert len(out["alignment"]) == len(tgt) - 1  # every target token but </s>
    for link in out["alignment"]:
        i, j = link["target_index"], link["source_index"]
        assert link["target_token"] == tgt[i] and link["source_token"] == src[j] != "</s>"
        assert cross[i, j] == pytest.approx(cross[i, :-1].max(), abs=1e-3)
        assert link["weight"] == pytest.approx(cross[i, j], abs=1e-3)


@pytest.mark.parametrize(
    "extra",
    [
        {"layers": [99]},
        {"heads": [-1]},
        {"heads": [0, 0]},
        {"layers": []},
        {"kinds": ["bogus"]},
        {"level": "char"},
        {"q": ""},
        {"beam_size": 99},
    ],
)
def test_bad_filters_are_400(client: TestClient, extra: dict[str, Any]) -> None:
    assert_error(client.post("/attention", json={"q": TEXT, **DOC, **extra}), 400)


def test_payload_is_capped(client: TestClient) -> None:
    long_text = " ".join(["Ein Mann fährt Fahrrad."] * 12)  # more than 40 tokens
    assert_error(client.post("/attention", json={"q": long_text, **DOC}), 400, "text_too_long")
    medium = " ".join(["Ein Mann fährt Fahrrad."] * 5)  # under 40 tokens, but all maps exceed 20,000 values
    body = assert_error(client.post("/attention", json={"q": medium, **DOC}), 400, "payload_too_large")
    assert "fewer" in body["error"]
    assert client.post("/attention", json={"q": medium, **DOC, "kinds": ["cross"], "heads": [0]}).status_code == 200
