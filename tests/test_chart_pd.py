"""The chart's operator and autoscaler can run the P/D examples: every child the operator
renders for them is a kind the chart's RBAC lets it apply, the prefill pool it deletes is
one it may delete, the autoscaler may patch the prefill replicas, and the images pass the
chart's default allow-list (so the operator renders rather than refuses them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from servefleet.api.manifests import load_llmdeployments
from servefleet.operator import render
from servefleet.operator.policy import refusal
from servefleet.operator.pool_cleanup import PREFILL_POOL_KINDS
from tests.test_chart_static import CHART, component_rules, verbs_on

ROOT = Path(__file__).resolve().parents[1]
PLURALS = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "Deployment": "deployments",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "ServiceMonitor": "servicemonitors",
}


def chart_settings() -> render.RenderSettings:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return render.RenderSettings(
        engine_image="ghcr.io/servefleet/servefleet:test",
        gateway_url="http://servefleet-gateway.servefleet:8080",
        route_signing_key=b"k" * 32,
        allowed_images=tuple(values["operator"]["allowedImages"]),
    )


@pytest.mark.parametrize("example", ["llmdeployment-pd.yaml", "vllm-pd.yaml"])
def test_the_charts_operator_renders_and_may_apply_a_pd_deployment(example: str) -> None:
    (dep,) = load_llmdeployments(ROOT / "examples" / example)
    dep = dep.model_copy(update={"metadata": dep.metadata.model_copy(update={"uid": "u"})})
    settings = chart_settings()
    assert refusal(dep, settings.policy) is None
    children = render.children(dep, settings, with_service_monitor=True)
    names = {(c["kind"], c["metadata"]["name"]) for c in children}
    assert ("Deployment", f"{dep.name}-prefill") in names
    assert ("Service", f"{dep.name}-prefill") in names
    operator = component_rules("operator")
    for child in children:
        assert {"create", "patch"} <= verbs_on(operator, PLURALS[child["kind"]]), child["kind"]
    # the prefill pool is read, then deleted when its block is removed
    for kind in PREFILL_POOL_KINDS:
        assert {"get", "delete"} <= verbs_on(operator, kind.plural), kind.plural
    pool = {
        (c["kind"], c["metadata"]["name"])
        for c in children
        if c["metadata"]["name"].endswith("-prefill")
    }
    assert {kind for kind, _ in pool} == {k.kind for k in PREFILL_POOL_KINDS}
    assert "patch" in verbs_on(component_rules("autoscaler"), "llmdeployments")
