"""The chart's alerting rules name series our components really export.

Static half of the proof (no Prometheus): every metric an alert reads is exported by the
gateway's, autoscaler's or engine's own registry, or named by an engine adapter in
`servefleet.api.engines` (vLLM, SGLang), or is kube-state-metrics' restart counter; every
label it groups or joins on exists there. `e2e/test_alerts.py` runs `promtool check rules`
and makes each alert fire on a real Prometheus. Every `outcome` a rule names is one of
`servefleet.api.outcomes.Outcome`, and the error budget classes them as that module does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from servefleet.api.conventions import ENGINE_CONTAINER
from servefleet.api.engines import ENGINE_ADAPTERS
from servefleet.api.outcomes import BURNS_ERROR_BUDGET, TENANTS_OWN
from tests.test_dashboards import (
    MATCHER,
    TARGET_LABELS,
    all_series,
    outcome_matchers,
    unknown_outcomes,
)

CHART = Path(__file__).resolve().parents[1] / "charts" / "servefleet"
ALERTS = CHART / "files" / "alerts"
# Series of kube-state-metrics, which every Prometheus on Kubernetes scrapes.
KUBE_STATE_METRICS = {"kube_pod_container_status_restarts_total": {"namespace", "pod", "container"}}
RULE_METRIC = re.compile(r"(?<![\w:])((?:vllm:|sglang:|servefleet[_:]|kube_)[A-Za-z0-9_:]*)")
SELECTOR = re.compile(RULE_METRIC.pattern + r"\{([^}]*)\}")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
EXPECTED = {
    "ServefleetErrorBudgetBurnFast",
    "ServefleetErrorBudgetBurnSlow",
    "ServefleetPoolAtMaxReplicasWithQueue",
    "ServefleetSpillOverHigh",
    "ServefleetKVCacheSaturated",
    "ServefleetNoReadyReplica",
    "ServefleetEngineRestarting",
    "ServefleetRedisDown",
    "ServefleetTenantBudgetHigh",
    "ServefleetAutoscalerNotActing",
}


def rules() -> Iterator[dict[str, Any]]:
    for path in sorted(ALERTS.glob("*.yaml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            yield from group["rules"]


def known_series() -> dict[str, set[str]]:
    """Every series an alert may read → its labels (recording rules carry their `by`)."""
    series = all_series() | KUBE_STATE_METRICS
    for adapter in ENGINE_ADAPTERS.values():
        names = adapter.metrics
        for name in (names.requests_waiting, names.requests_running, names.kv_cache_usage):
            series.setdefault(name, {"model_name"})
    for rule in rules():
        if "record" in rule:
            series[rule["record"]] = set(
                GROUPING.findall(rule["expr"])[0].replace(" ", "").split(",")
            )
    return series


def test_the_alerts_the_issue_asks_for_exist_and_say_what_to_do() -> None:
    alerts = [r for r in rules() if "alert" in r]
    assert {r["alert"] for r in alerts} == EXPECTED
    for rule in alerts:
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), (
            f"{name}: `for` is what the chart may replace"
        )
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 80, name


@pytest.mark.parametrize("rule", list(rules()), ids=lambda r: r.get("alert") or r["record"])
def test_every_metric_and_label_an_alert_reads_is_exported(rule: dict[str, Any]) -> None:
    series = known_series()
    expr = rule["expr"]
    metrics = RULE_METRIC.findall(expr)
    assert metrics, expr
    labels = set(TARGET_LABELS)
    for metric in metrics:
        assert metric in series, f"{metric} is exported by no component"
        labels |= series[metric]
    for metric, matchers in SELECTOR.findall(expr):
        for label, _op, _value in MATCHER.findall(matchers):
            assert label in series[metric] | TARGET_LABELS, f"{metric} has no label {label}"
    for grouping in GROUPING.findall(expr):
        for label in filter(None, (x.strip() for x in grouping.split(","))):
            assert label in labels, f"nothing in {expr} has label {label}"


def test_engine_alerts_use_the_adapters_names() -> None:
    """KV-cache saturation reads each engine kind's own series, as the autoscaler does."""
    by_name = {r["alert"]: r["expr"] for r in rules() if "alert" in r}
    for adapter in ENGINE_ADAPTERS.values():
        assert adapter.metrics.kv_cache_usage in by_name["ServefleetKVCacheSaturated"]
        assert not adapter.metrics.kv_cache_is_percent  # the threshold 0.95 is a fraction
    assert f'container="{ENGINE_CONTAINER}"' in by_name["ServefleetEngineRestarting"]


def test_the_chart_ships_the_file_with_for_overrides() -> None:
    template = (CHART / "templates" / "prometheusrule.yaml").read_text()
    assert 'Files.Glob "files/alerts/*.yaml"' in template
    assert "kind: PrometheusRule" in template and 'set $rule "for"' in template
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["metrics"]["prometheusRule"] == {"enabled": False, "labels": {}, "for": {}}


@pytest.mark.parametrize("rule", list(rules()), ids=lambda r: r.get("alert") or r["record"])
def test_every_outcome_a_rule_names_exists(rule: dict[str, Any]) -> None:
    assert not unknown_outcomes(rule["expr"]), f"no such outcome in {rule['expr']}"


def test_the_error_budget_classes_outcomes_as_the_api_does() -> None:
    """Failures of ours over everything but the tenant's own doing: the same sets as
    `servefleet.api.outcomes`, so a new outcome is classed in one place and the rules follow."""
    ratios = [r for r in rules() if "gateway_error_ratio" in r.get("record", "")]
    assert len(ratios) == 4
    ours = frozenset(o.value for o in BURNS_ERROR_BUDGET)
    tenants = frozenset(o.value for o in TENANTS_OWN)
    for rule in ratios:
        assert sorted(outcome_matchers(rule["expr"])) == [("!~", tenants), ("=~", ours)], rule
