"""The chart's Grafana dashboards query series our components really export.

Static half of the proof (fast, no Prometheus): every metric a panel names exists in the
engine's, gateway's or autoscaler's own registry with the labels the query uses, and the
engine adapters (`servefleet.api.engines`) name real series. `e2e/test_dashboards.py`
evaluates every query against a real Prometheus scraping real processes. An `outcome` a query
or a panel names must be one of `servefleet.api.outcomes.Outcome`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from servefleet.api.engines import ENGINE_ADAPTERS
from servefleet.api.lora import (
    LORA_ADAPTER_LABEL,
    LORA_ADAPTERS_LOADED_METRIC,
    LORA_EVICTIONS_METRIC,
    LORA_LOAD_SECONDS_METRIC,
    LORA_LOADS_METRIC,
    LORA_REQUESTS_METRIC,
    LORA_TOKENS_METRIC,
)
from servefleet.api.outcomes import Outcome
from servefleet.autoscaler.telemetry import AutoscalerMetrics
from servefleet.engine.metrics import EngineMetrics
from servefleet.gateway.metrics import GatewayMetrics

DASHBOARDS = Path(__file__).resolve().parents[1] / "charts" / "servefleet" / "files" / "dashboards"
# Labels Prometheus adds to every scraped series; a ServiceMonitor scrape (the chart's, the
# operator's) adds the namespace, Service and pod of the target as well.
TARGET_LABELS = {"instance", "job", "namespace", "service", "pod"}
METRIC = re.compile(r"(?<![\w:])((?:vllm:|servefleet_)[A-Za-z0-9_:]*)")
SELECTOR = re.compile(r"((?:vllm:|servefleet_)[A-Za-z0-9_:]*)\{([^}]*)\}")
MATCHER = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*\"([^\"]*)\"\s*")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
VARIABLE = re.compile(r"\$\{?(\w+)(?::\w+)?\}?")
OUTCOME_MATCHER = re.compile(r"\boutcome\s*(=~|!~|!=|=)\s*\"([^\"]*)\"")


def outcome_matchers(expr: str) -> list[tuple[str, frozenset[str]]]:
    """Each `outcome` matcher of a query: its operator and the values it names (a regex
    matcher's alternatives; each must be a whole outcome, not a pattern)."""
    return [(op, frozenset(value.split("|"))) for op, value in OUTCOME_MATCHER.findall(expr)]


def unknown_outcomes(expr: str) -> set[str]:
    named = {value for _, values in outcome_matchers(expr) for value in values}
    return named - {o.value for o in Outcome}


def exported_series(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Every series name a registry exposes (suffixes included) → its label names."""
    series: dict[str, set[str]] = {}
    # prometheus_client has no public "label names of a collector" API.
    for collector, names in registry._collector_to_names.items():
        labels = set(getattr(collector, "_labelnames", ()))
        kind = getattr(collector, "_type", "")
        for name in names:
            series[name] = labels | ({"le"} if kind == "histogram" else set())
    return series


def all_series() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for registry in (
        EngineMetrics("m").registry,
        GatewayMetrics().registry,
        AutoscalerMetrics().registry,
    ):
        found |= exported_series(registry)
    return found


def dashboards() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, json.loads(p.read_text())) for p in sorted(DASHBOARDS.glob("*.json"))]


def panel_targets(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, expr) of every query of every panel (rows included)."""
    for panel in board["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                yield inner["title"], target["expr"]


def variable_queries(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            yield var["name"], query["query"] if isinstance(query, dict) else query


def test_there_are_dashboards_with_queries() -> None:
    boards = dashboards()
    assert {name for name, _ in boards} >= {"servefleet-overview.json", "servefleet-engines.json"}
    for name, board in boards:
        targets = list(panel_targets(board))
        assert len(targets) >= 10, name
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in board["panels"]:
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
                assert panel.get("description"), f"{name}: {panel['title']} says nothing"


@pytest.mark.parametrize("name,board", dashboards())
def test_every_queried_metric_and_label_is_exported(name: str, board: dict[str, Any]) -> None:
    series = all_series()
    exprs = [*panel_targets(board), *variable_queries(board)]
    for title, expr in exprs:
        metrics = METRIC.findall(expr)
        assert metrics, f"{name} / {title}: no servefleet or vllm metric in {expr}"
        known_labels = set(TARGET_LABELS)
        for metric in metrics:
            assert metric in series, f"{name} / {title}: {metric} is not exported by any component"
            known_labels |= series[metric]
        for metric, matchers in SELECTOR.findall(expr):
            for label, _op, _value in MATCHER.findall(matchers):
                assert label in series[metric] | TARGET_LABELS, (
                    f"{name} / {title}: {metric} has no label {label}"
                )
        for grouping in GROUPING.findall(expr):
            for label in filter(None, (x.strip() for x in grouping.split(","))):
                assert label in known_labels, f"{name} / {title}: nothing has label {label}"
        label_values = re.search(r"label_values\([^,]+,\s*(\w+)\)", expr)
        if label_values:
            assert label_values.group(1) in known_labels, f"{name} / {title}"


@pytest.mark.parametrize("name,board", dashboards())
def test_template_variables_are_only_used_as_regex_matchers(
    name: str, board: dict[str, Any]
) -> None:
    """Multi-value variables expand to `a|b`, which only a regex matcher reads right."""
    defined = {v["name"] for v in board["templating"]["list"]}
    for title, expr in [*panel_targets(board), *variable_queries(board)]:
        for used in VARIABLE.findall(expr):
            if used.startswith("__"):
                continue  # Grafana's own ($__rate_interval)
            assert used in defined, f"{name} / {title}: ${used} is not defined"
            assert re.search(rf"=~\"\$\{{?{used}\b", expr), (
                f'{name} / {title}: ${used} must be used as label=~"${used}"'
            )


@pytest.mark.parametrize("name,board", dashboards())
def test_dashboards_filter_by_namespace_and_deployment(name: str, board: dict[str, Any]) -> None:
    """One Grafana for many installs and teams: every query follows the namespace picked, and
    the deployment: the engines' Service, or the `deployment` label where a series has one."""
    variables = [v["name"] for v in board["templating"]["list"]]
    assert variables[1] == "namespace", name
    engines = "vllm:" in json.dumps(board)
    assert ("service" if engines else "deployment") in variables, name
    series = all_series()
    for title, expr in panel_targets(board):
        for metric, matchers in SELECTOR.findall(expr):
            labels = {label for label, _, _ in MATCHER.findall(matchers)}
            assert "namespace" in labels, f"{name} / {title}: {metric}"
            if engines:
                assert "service" in labels, f"{name} / {title}: {metric}"
            elif "deployment" in series[metric]:
                assert "deployment" in labels, f"{name} / {title}: {metric}"


def test_engine_adapters_name_series_the_engines_export() -> None:
    """Our engine exports vLLM's names, which the adapters table (read by the operator and
    the autoscaler alike) must name."""
    ours = exported_series(EngineMetrics("m").registry)
    servefleet = ENGINE_ADAPTERS["servefleet"].metrics
    for name in (servefleet.requests_waiting, servefleet.requests_running):
        assert name in ours
    assert servefleet.kv_cache_usage in ours
    assert ENGINE_ADAPTERS["vllm"].metrics == servefleet
    assert ENGINE_ADAPTERS["vllm"].metrics.kv_cache_usage == "vllm:kv_cache_usage_perc"


def test_the_engines_dashboard_has_the_adapter_panels() -> None:
    """Every LoRA series the engine exports is charted under the row "LoRA adapters", the
    per-adapter ones split by the adapter label and filtered by its variable."""
    (board,) = [b for name, b in dashboards() if name == "servefleet-engines.json"]
    (row,) = [p for p in board["panels"] if p["type"] == "row" and p["title"] == "LoRA adapters"]
    below = [p for p in board["panels"] if p["gridPos"]["y"] > row["gridPos"]["y"]]
    exprs = [expr for title, expr in panel_targets({"panels": below})]
    charted = {metric for expr in exprs for metric in METRIC.findall(expr)}
    series = all_series()
    for name in (LORA_ADAPTERS_LOADED_METRIC, LORA_LOADS_METRIC, LORA_EVICTIONS_METRIC):
        assert f"{name}_total" in charted or name in charted, name
    assert f"{LORA_LOAD_SECONDS_METRIC}_bucket" in charted
    for name in (LORA_REQUESTS_METRIC, LORA_TOKENS_METRIC):
        assert LORA_ADAPTER_LABEL in series[f"{name}_total"]
        (expr,) = [e for e in exprs if f"{name}_total" in e]
        assert f"by ({LORA_ADAPTER_LABEL})" in expr
        assert f'{LORA_ADAPTER_LABEL}=~"${LORA_ADAPTER_LABEL}"' in expr
    assert LORA_ADAPTER_LABEL in {v["name"] for v in board["templating"]["list"]}


def test_an_outcome_that_does_not_exist_is_found() -> None:
    expr = 'sum(rate(servefleet_gateway_requests_total{outcome=~"503|shed", model="m"}[5m]))'
    assert outcome_matchers(expr) == [("=~", frozenset({"503", "shed"}))]
    assert unknown_outcomes(expr) == {"shed"}
    assert unknown_outcomes('x{outcome!="ok"}') == set()


@pytest.mark.parametrize("name,board", dashboards())
def test_every_outcome_a_dashboard_names_exists(name: str, board: dict[str, Any]) -> None:
    for title, expr in [*panel_targets(board), *variable_queries(board)]:
        assert not unknown_outcomes(expr), f"{name} / {title}: no such outcome"


def test_the_outcome_panel_explains_every_outcome() -> None:
    """A new outcome shows up in the panel on its own (`sum by (outcome)`); its description
    must say what it means."""
    (board,) = [b for name, b in dashboards() if name == "servefleet-overview.json"]
    (panel,) = [p for p in board["panels"] if p["title"] == "Requests by outcome"]
    for outcome in Outcome:
        assert outcome.value in panel["description"], outcome
