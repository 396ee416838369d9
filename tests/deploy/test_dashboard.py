"""The Grafana dashboard without a server: it loads, is laid out sanely, and has the panels it promises.

tests/e2e/test_deploy.py checks its queries against a live /metrics and a real Prometheus.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy import dashboard


@pytest.fixture(scope="module")
def board() -> dict[str, Any]:
    return dashboard.load()


def test_loads_with_unique_ids_and_a_stable_uid(board: dict[str, Any]) -> None:
    assert board["uid"] == "translator" and board["title"]
    ids = [p["id"] for p in dashboard.panels(board)]
    assert len(ids) == len(set(ids))


def test_panels_fit_the_grid_without_overlap(board: dict[str, Any]) -> None:
    taken: set[tuple[int, int]] = set()
    for panel in dashboard.panels(board):
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


@pytest.mark.parametrize(
    ("title_word", "metric"),
    [
        ("Request rate", "translator_requests_total"),
        ("latency p50 / p95 / p99", "translator_request_duration_seconds_bucket"),
        ("Queue depth", "translator_queue_depth"),
        ("Batch size (sentences)", "translator_batch_sentences_bucket"),
        ("Tokens per second", "translator_target_tokens_total"),
        ("Errors by status", "translator_requests_total"),
    ],
)
def test_promised_panels_exist(board: dict[str, Any], title_word: str, metric: str) -> None:
    matching = [q for q in dashboard.queries(board) if title_word in q.panel]
    assert matching, f"no panel titled ...{title_word}..."
    assert any(metric in dashboard.metric_names(q.expr) for q in matching)


def test_latency_panel_has_the_three_quantiles(board: dict[str, Any]) -> None:
    exprs = [q.expr for q in dashboard.queries(board) if q.panel == "/translate latency p50 / p95 / p99"]
    assert [e.split(",")[0] for e in exprs] == [f"histogram_quantile({p}" for p in ("0.5", "0.95", "0.99")]


def test_errors_panel_groups_by_status(board: dict[str, Any]) -> None:
    (expr,) = [q.expr for q in dashboard.queries(board) if q.panel == "Errors by status"]
    assert "sum by (status)" in expr and 'status!~"2.."' in expr


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (le) (rate(a_bucket{x="1", y=~"$v"}[$__rate_interval]))', {"a_bucket"}),
        ("histogram_quantile(0.95, sum by (le, endpoint) (rate(b_bucket[5m])))", {"b_bucket"}),
        ('(sum(rate(c_total{s=~"5.."}[1m])) or vector(0)) / clamp_min(sum(d), 1e-9)', {"c_total", "d"}),
        ("e_total offset 5m / on(instance) group_left f", {"e_total", "f"}),
        ("label_values(g_info, instance)", {"g_info"}),
    ],
)
def test_metric_name_extraction(expr: str, names: set[str]) -> None:
    assert dashboard.metric_names(expr) == names


def test_label_matcher_extraction() -> None:
    found = dashboard.label_matchers('rate(a{x="}", y!~"2.."}[1m]) + b{z="1"}')
    assert found == {"a": {"x", "y"}, "b": {"z"}}
