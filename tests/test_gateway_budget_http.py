"""Budgets over HTTP: the 429 `insufficient_quota` of an exhausted budget (OpenAI's shape, the
budget and its reset named), the warning headers from 80 % used, the used-ratio gauge, and a
tenant that tries to reset or raise its own budget through headers or request fields."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from servefleet.api.budgets import BUDGET_USED_RATIO_METRIC, TokenPrices, budget_header
from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    RedisConfig,
    SecretValueRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.llmdeployment import TenantLimits
from servefleet.bench.fake_upstream import FakeBehaviour, FakeOpenAI
from servefleet.bench.processes import free_port, serve_in_thread
from servefleet.gateway.app import Gateway

CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello there"}],
    "max_tokens": 8,
}
INTERNAL = {"authorization": "Bearer internal-key"}
PRICES = TokenPrices.model_validate({"inputPerMillionUSD": 1000.0, "outputPerMillionUSD": 5000.0})
ISO = re.compile(r"^\d{4}-\d\d-\d\dT00:00:00Z$")


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer key-{name}"}


class Rig:
    def __init__(self, base: str, internal: str) -> None:
        self.base, self.internal = base, internal

    def chat(self, tenant: str = "a", **extra: Any) -> httpx.Response:
        headers = {**auth(tenant), **extra.pop("headers", {})}
        return httpx.post(
            self.base + "/v1/chat/completions", headers=headers, json={**CHAT, **extra}
        )

    def until_refused(self, tenant: str = "a", **extra: Any) -> list[httpx.Response]:
        answers = [self.chat(tenant, **extra)]
        while answers[-1].status_code == 200:
            assert len(answers) < 100, "the budget never ran out"
            answers.append(self.chat(tenant, **extra))
        return answers


@pytest.fixture
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    """A gateway with tenant `a` under the budget limits given, tenant `b` unlimited."""
    limits: dict[str, Any] = dict(request.param)
    dead_redis = limits.pop("dead_redis", False)  # a Redis URL where nothing listens
    with ExitStack() as stack:
        replica = stack.enter_context(serve_in_thread(FakeOpenAI(FakeBehaviour())))
        config = GatewayConfig(
            tenants=[
                GatewayTenant(
                    name=name,
                    api_keys=[ApiKeyRef(sha256=hash_api_key(f"key-{name}"))],
                    limits=TenantLimits.model_validate(lim),
                )
                for name, lim in (("a", limits), ("b", {}))
            ],
            deployments=[
                GatewayDeployment(
                    name="d",
                    model="m",
                    tenants=[TenantAccess(name="a"), TenantAccess(name="b")],
                    token_prices=PRICES,
                )
            ],
            internal_api_key=SecretValueRef(value="internal-key"),
            redis=RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0") if dead_redis else None,
        )
        gateway = Gateway(config, environ={})
        gateway.set_replicas("d", [replica], ready=[replica])
        base = stack.enter_context(serve_in_thread(gateway))
        internal = stack.enter_context(serve_in_thread(gateway.internal, lifespan="off"))
        yield Rig(base, internal)


@pytest.mark.parametrize("rig", [{"dailyTokenBudget": 100}], indirect=True)
def test_an_exhausted_budget_is_openais_insufficient_quota(rig: Rig) -> None:
    answers = rig.until_refused()
    refused = answers[-1]
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["type"] == error["code"] == "insufficient_quota"
    assert "daily token budget of 100 tokens" in error["message"]
    reset = refused.headers[budget_header("daily", "tokens", "reset")]
    assert ISO.match(reset) and reset in error["message"]
    to_midnight = 86400 - time.time() % 86400
    assert abs(int(refused.headers["retry-after"]) - to_midnight) < 60
    assert rig.chat("b").status_code == 200  # another tenant is not charged


@pytest.mark.parametrize("rig", [{"dailyTokenBudget": 100}], indirect=True)
def test_headers_warn_from_80_percent_and_the_gauge_follows(rig: Rig) -> None:
    answers = rig.until_refused()
    ratio = budget_header("daily", "tokens", "used-ratio")
    warned = [r for r in answers if ratio in r.headers]
    assert warned and warned[0] is not answers[0]  # nothing to say while far from it
    for response in answers:
        if ratio in response.headers:
            assert float(response.headers[ratio]) >= 0.8
            remaining = int(response.headers[budget_header("daily", "tokens", "remaining")])
            assert 0 <= remaining <= 20
    metrics = httpx.get(rig.internal + "/metrics", headers=INTERNAL).text
    line = next(x for x in metrics.splitlines() if x.startswith(BUDGET_USED_RATIO_METRIC + "{"))
    assert 'tenant="a"' in line and 'period="daily"' in line and 'unit="tokens"' in line
    assert float(line.rsplit(" ", 1)[1]) >= 0.8


@pytest.mark.parametrize("rig", [{"dailyCostBudgetUSD": 0.5}], indirect=True)
def test_a_cost_budget_is_priced_by_the_deployment(rig: Rig) -> None:
    answers = rig.until_refused()
    # Each request uses 2 prompt + 8 completion tokens: 0.002 + 0.04 = 0.042 USD.
    assert len(answers) - 1 == pytest.approx(0.5 / 0.042, abs=1)
    error = answers[-1].json()["error"]
    assert error["code"] == "insufficient_quota"
    assert "daily cost budget of 0.50 USD" in error["message"]
    remaining = float(answers[-1].headers[budget_header("daily", "cost", "remaining")])
    assert 0 <= remaining < 0.1


ATTACK_HEADERS = {
    budget_header("daily", "tokens", "remaining"): "1000000",
    budget_header("daily", "tokens", "used-ratio"): "0",
    budget_header("daily", "tokens", "reset"): "1970-01-01T00:00:00Z",
    "x-servefleet-tenant": "b",
    "x-ratelimit-remaining-tokens": "1000000",
}


@pytest.mark.parametrize("rig", [{"dailyTokenBudget": 100}], indirect=True)
def test_attack_a_tenant_cannot_reset_or_raise_its_own_budget(rig: Rig) -> None:
    """Budget headers a tenant sends are not read; budget-like request fields are refused
    (400 naming them) and spend nothing; the budget holds."""
    spent = rig.until_refused(headers=ATTACK_HEADERS)
    assert spent[-1].json()["error"]["code"] == "insufficient_quota"
    for field, value in (
        ("budget", {"daily_tokens": 10**9}),
        ("daily_token_budget", 10**9),
        ("limits", {"dailyTokenBudget": 10**9}),
    ):
        refused = rig.chat(**{field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    for body in ({"user": "b"}, {"metadata": {"budget": "unlimited"}}):
        assert rig.chat(headers=ATTACK_HEADERS, **body).status_code in {400, 429}
    still = rig.chat(headers=ATTACK_HEADERS)
    assert still.status_code == 429 and still.json()["error"]["code"] == "insufficient_quota"


@pytest.mark.parametrize("rig", [{"monthlyTokenBudget": 1000, "dead_redis": True}], indirect=True)
def test_budgets_are_not_spent_while_redis_is_unreachable(rig: Rig) -> None:
    refused = rig.chat()
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "budget_unavailable"
    assert rig.chat("b").status_code == 200  # no budget: served on per-replica limits
