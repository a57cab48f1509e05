"""Metric names used by PromQL expressions (dashboard, rules), and names a /metrics exports.

Not a PromQL parser: enough for the expressions in deploy/ (selectors, aggregations with
`by (...)`, binary operators, ranges). Strings, label matchers, label lists and ranges are
removed first; what is left that is not a function call or a keyword is a metric name.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_STRIP = (
    re.compile(r'"(?:[^"\\]|\\.)*"'),  # strings (label values, regexes)
    re.compile(r"\{[^}]*\}"),  # label matchers
    re.compile(r"\[[^\]]*\]"),  # ranges
    re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"),
)
_IDENT = re.compile(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()")


def metric_names(expr: str) -> set[str]:
    text = expr
    for pattern in _STRIP:
        text = pattern.sub(" ", text)
    return {name for name in _IDENT.findall(text) if name.lower() not in _KEYWORDS}


def dashboard_exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, expr) for every panel target, template variable and annotation query."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
            assert inner, query
            yield f"variable {var['name']}", inner.group(1)
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if "expr" in annotation:
            yield f"annotation {annotation['name']!r}", annotation["expr"]


def rules_exprs(rules: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for group in rules["groups"]:
        for rule in group["rules"]:
            yield rule.get("alert") or rule["record"], rule["expr"]


def recorded_names(rules: dict[str, Any]) -> set[str]:
    return {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}


def exported_names(metrics_text: str) -> set[str]:
    """The sample names a /metrics page can carry, from its `# TYPE` lines (a labelled series
    with no child yet still has its TYPE line)."""
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("_sum", "_count", ""),
        "gauge": ("",),
        "untyped": ("",),
    }
    names: set[str] = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            base = name.removesuffix("_total") if kind == "counter" else name
            names.update(base + suffix for suffix in suffixes.get(kind, ("",)))
    return names


def with_grafana_variables(expr: str) -> str:
    """`expr` as Prometheus can run it: Grafana's variables replaced by values."""
    return (
        expr.replace("$__rate_interval", "1m")
        .replace("$__interval", "1m")
        .replace('"$instance"', '".*"')
        .replace('"$model"', '".*"')
    )
