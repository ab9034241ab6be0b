"""Budget fields in the spec: validated where they are written (pydantic and the CRD's CEL),
carried unchanged into the gateway config both modes run."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from servefleet.api.budgets import COST_BUDGET_MESSAGE
from servefleet.api.crd import crd_manifest
from servefleet.api.gateway_config import GatewayConfig
from servefleet.api.gateway_render import ResolvedSecretKeys, render_gateway_config
from servefleet.gateway.budgets import Budget
from servefleet.gateway.route_table import _scopes
from tests.test_gateway_render import deployment, resolve

PRICES = {"tokenPrices": {"inputPerMillionUSD": 0.5, "outputPerMillionUSD": 1.5}}


def costed(where: str = "limits") -> dict[str, Any]:
    return {
        "tenants": [
            {
                "name": "acme",
                "apiKeySecretRef": {"name": "acme-key", "key": "api-key"},
                where: {"dailyCostBudgetUSD": 5, "monthlyTokenBudget": 10**8},
            }
        ]
    }


@pytest.mark.parametrize("where", ["limits", "modelLimits"])
def test_a_cost_budget_needs_token_prices(where: str) -> None:
    with pytest.raises(ValidationError, match=COST_BUDGET_MESSAGE):
        deployment("d", "m", **costed(where))
    assert deployment("d", "m", **costed(where), **PRICES).spec.token_prices is not None


@pytest.mark.parametrize(
    "limits",
    [
        {"dailyCostBudgetUSD": 0},
        {"monthlyCostBudgetUSD": -1},
        {"monthlyTokenBudget": 0},
        {"dailyCostBudget": 5},  # a misspelt field is refused, not ignored
    ],
)
def test_bad_budgets_are_refused(limits: dict[str, Any]) -> None:
    spec = costed()
    spec["tenants"][0]["limits"] = limits
    with pytest.raises(ValidationError):
        deployment("d", "m", **spec, **PRICES)


def test_negative_prices_are_refused() -> None:
    prices = {"tokenPrices": {"inputPerMillionUSD": -1, "outputPerMillionUSD": 1}}
    with pytest.raises(ValidationError):
        deployment("d", "m", **prices)


def test_the_api_server_checks_the_same_rule() -> None:
    spec = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    rules = spec["spec"]["x-kubernetes-validations"]
    rule = next(r for r in rules if r["message"] == COST_BUDGET_MESSAGE)
    assert "has(self.tokenPrices)" in rule["rule"]
    for field in ("limits", "modelLimits"):
        assert f"t.{field}.dailyCostBudgetUSD" in rule["rule"]
        assert f"t.{field}.monthlyCostBudgetUSD" in rule["rule"]


def test_budgets_and_prices_reach_the_gateway_scopes() -> None:
    config = render_gateway_config(
        [deployment("d", "m", **costed(), **PRICES)], {}, ResolvedSecretKeys(resolve)
    )
    assert config.deployments[0].token_prices is not None
    tenant = config.tenants[0]
    (scope,) = _scopes("acme", "m", tenant.limits, None)
    assert scope.policy.budgets == (
        Budget("monthly", "tokens", 10**8),
        Budget("daily", "cost", 5_000_000),
    )
    # A gateway config written by hand is checked too.
    raw = config.model_dump(mode="json", by_alias=True)
    raw["deployments"][0]["token_prices"] = None
    with pytest.raises(ValidationError, match="has a cost budget but the deployment has no"):
        GatewayConfig.model_validate(raw)
