"""The Grafana dashboard's queries, and the metric names and label matchers they use."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "translator.json"
KEYWORDS = frozenset(
    [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "inf",
        "nan",
    ]
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_DURATION = re.compile(r"(?<![\w:])(?:\d+(?:ms|[smhdwy]))+(?![\w:])")
_NUMBER = re.compile(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_IDENT = re.compile(r"(?<![\w:$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_SELECTOR = re.compile(r"(?<![\w:])([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,")


@dataclass(frozen=True)
class Query:
    panel: str
    expr: str


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    out: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def queries(dashboard: dict[str, Any]) -> list[Query]:
    found = [Query(p["title"], t["expr"]) for p in panels(dashboard) for t in p.get("targets", []) if "expr" in t]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        if text:
            found.append(Query(f"variable {variable['name']}", text))
    return found


def metric_names(expr: str) -> set[str]:
    """Series names a PromQL expression (or a Grafana ``label_values(...)`` query) selects."""
    if (match := _LABEL_VALUES.search(expr)) is not None:
        return {match.group(1)}
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    text = _DURATION.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        name, is_call = match.group(1), match.group(2)
        if not is_call and name.lower() not in KEYWORDS:
            names.add(name)
    return names


def label_matchers(expr: str) -> dict[str, set[str]]:
    """Metric name -> label names used in its ``{...}`` matchers."""
    out: dict[str, set[str]] = {}
    for name, body in _SELECTOR.findall(_STRING.sub(lambda m: m.group(0).replace("}", ""), expr)):
        out.setdefault(name, set()).update(_MATCHER.findall(_STRING.sub('""', body)))
    return out


def concrete(expr: str, rate_interval: str = "30s") -> str:
    """The query as Grafana sends it with every replica selected."""
    return expr.replace("$__rate_interval", rate_interval).replace('"$instance"', '".*"')
