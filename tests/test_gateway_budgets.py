"""Tenant budgets in the limiter: reservation and settlement arithmetic (tokens and cost), UTC
period rollover on an injected clock, and on a real Redis shared by two gateway instances:
concurrent load, a gateway restart, and a reservation a dead gateway never settled."""

from __future__ import annotations

import asyncio
import calendar
import random
from pathlib import Path

import pytest
import yaml

from servefleet.api.budgets import BUDGET_WARN_RATIO, TokenPrices
from servefleet.api.llmdeployment import TenantLimits
from servefleet.gateway.budgets import (
    Budget,
    budgets_of,
    iso_utc,
    period_end,
    period_id,
)
from servefleet.gateway.limits import LimitPolicy, LimitScope, LocalLimiter, RequestTooLarge
from servefleet.gateway.limits_redis import RedisLimiter

ROOT = Path(__file__).resolve().parents[1]
# 2026-12-31 23:00 UTC: an hour before both a day and a month end.
NEW_YEARS_EVE = float(calendar.timegm((2026, 12, 31, 23, 0, 0)))
PRICES = TokenPrices.model_validate({"inputPerMillionUSD": 2.0, "outputPerMillionUSD": 10.0})


class Wall:
    def __init__(self, now: float = NEW_YEARS_EVE) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def scope(*budgets: Budget, key: str = "t:acme") -> list[LimitScope]:
    return [LimitScope(key, LimitPolicy(budgets=budgets))]


def test_periods_are_utc_calendar_days_and_months() -> None:
    assert period_id("daily", NEW_YEARS_EVE) != period_id("daily", NEW_YEARS_EVE + 3600)
    assert period_id("monthly", NEW_YEARS_EVE) == "m2026-12"
    assert period_id("monthly", NEW_YEARS_EVE + 3600) == "m2027-01"
    assert iso_utc(period_end("daily", NEW_YEARS_EVE)) == "2027-01-01T00:00:00Z"
    assert iso_utc(period_end("monthly", NEW_YEARS_EVE)) == "2027-01-01T00:00:00Z"
    feb = float(calendar.timegm((2028, 2, 10, 12, 0, 0)))  # a leap year
    assert iso_utc(period_end("monthly", feb)) == "2028-03-01T00:00:00Z"


def test_costs_are_whole_micro_usd_rounded_up() -> None:
    # 1 USD per million tokens is one micro-USD a token.
    assert PRICES.micro_usd(1000, 100) == 2 * 1000 + 10 * 100
    cheap = TokenPrices.model_validate({"inputPerMillionUSD": 0.15, "outputPerMillionUSD": 0.6})
    assert cheap.micro_usd(10, 0) == 2  # 1.5 rounds up: a budget is never undercharged
    assert cheap.micro_usd(0, 0) == 0


def test_spec_budgets_become_limiter_budgets() -> None:
    limits = TenantLimits.model_validate(
        {"dailyTokenBudget": 1000, "monthlyTokenBudget": 20000, "monthlyCostBudgetUSD": 12.5}
    )
    assert budgets_of(limits) == (
        Budget("daily", "tokens", 1000),
        Budget("monthly", "tokens", 20000),
        Budget("monthly", "cost", 12_500_000),
    )


async def test_tokens_are_reserved_whole_and_settled_with_what_was_used() -> None:
    limiter = LocalLimiter(wall_clock=Wall())
    day = scope(Budget("daily", "tokens", 1000))
    first = await limiter.reserve(day, 700)  # prompt + max_tokens
    assert first.admitted and first.reservation is not None
    assert first.budgets[0].used == 700 and first.budgets[0].remaining == 300
    refused = await limiter.reserve(day, 400)
    assert not refused.admitted and refused.exceeded == "budget"
    exhausted = refused.exhausted
    assert exhausted is not None and exhausted.used == 700 and exhausted.charge.amount == 400
    await limiter.settle(first.reservation, 500)  # 200 of the 700 were not used
    second = await limiter.reserve(day, 500)
    assert second.admitted and second.budgets[0].used == 1000
    with pytest.raises(RequestTooLarge, match="daily token budget"):
        await limiter.reserve(day, 1001)  # could never fit: a 400, not a 429


async def test_cost_is_reserved_at_max_tokens_and_settled_at_usage() -> None:
    limiter = LocalLimiter(wall_clock=Wall())
    usd = scope(Budget("daily", "cost", 50_000))  # 0.05 USD
    asked = PRICES.micro_usd(1000, 4000)  # 42,000: the prompt and max_tokens priced
    first = await limiter.reserve(usd, 5000, asked)
    assert first.admitted and first.reservation is not None
    assert not (await limiter.reserve(usd, 5000, asked)).admitted
    used = PRICES.micro_usd(1000, 500)  # 7,000: it stopped after 500 tokens
    await limiter.settle(first.reservation, 1500, used)
    again = await limiter.reserve(usd, 5000, asked)
    assert again.admitted and again.budgets[0].used == used + asked


async def test_the_tightest_scope_and_every_period_refuse() -> None:
    wall = Wall()
    limiter = LocalLimiter(wall_clock=wall)
    both = [
        LimitScope("t:acme", LimitPolicy(budgets=(Budget("monthly", "tokens", 10_000),))),
        LimitScope("t:acme:m:m", LimitPolicy(budgets=(Budget("daily", "tokens", 300),))),
    ]
    assert (await limiter.reserve(both, 300)).admitted
    refused = await limiter.reserve(both, 1)
    assert refused.exhausted is not None and refused.exhausted.budget.period == "daily"
    assert refused.retry_after_s == pytest.approx(3600)  # the day ends in an hour


async def test_a_new_period_starts_from_zero() -> None:
    wall = Wall()
    limiter = LocalLimiter(wall_clock=wall)
    month = scope(Budget("monthly", "tokens", 100))
    assert (await limiter.reserve(month, 100)).admitted
    refused = await limiter.reserve(month, 1)
    assert refused.exhausted is not None
    assert iso_utc(refused.exhausted.charge.resets_at) == "2027-01-01T00:00:00Z"
    wall.now += 3600  # January
    assert (await limiter.reserve(month, 100)).admitted


def test_the_alert_fires_where_the_headers_start() -> None:
    """One threshold: the chart's rule compares the gauge with the api's warning ratio."""
    alerts = ROOT / "charts" / "servefleet" / "files" / "alerts" / "servefleet-alerts.yaml"
    rules = [r for g in yaml.safe_load(alerts.read_text())["groups"] for r in g["rules"]]
    rule = next(r for r in rules if r.get("alert") == "ServefleetTenantBudgetHigh")
    assert rule["expr"].strip().endswith(f">= {BUDGET_WARN_RATIO}")


# --- a real Redis shared by two gateway instances --------------------------------------


def gateway(port: int, wall: Wall | None = None) -> RedisLimiter:
    url = f"redis://127.0.0.1:{port}/0"
    return RedisLimiter(url, timeout_s=10.0, wall_clock=wall or Wall())


async def test_two_gateways_under_concurrent_load_stay_within_one_reservation(
    redis_port: int,
) -> None:
    """200 concurrent requests of random size through two instances: what is charged never
    passes the budget, and the last refusal left less than one reservation unused."""
    limit, rng = 20_000, random.Random(7)
    budget = Budget("daily", "tokens", limit)
    a, b = gateway(redis_port), gateway(redis_port)
    admitted: list[int] = []
    refused: list[int] = []

    in_flight = asyncio.Semaphore(32)  # connections a loaded test machine opens in time

    async def one(limiter: RedisLimiter, tokens: int) -> None:
        async with in_flight:
            decision = await limiter.reserve(scope(budget), tokens)
            if decision.reservation is None:
                refused.append(tokens)
                return
            admitted.append(tokens)
            await asyncio.sleep(0)
            await limiter.settle(decision.reservation, tokens)  # used what it reserved

    sizes = [rng.randint(50, 400) for _ in range(200)]
    await asyncio.gather(*(one((a, b)[i % 2], n) for i, n in enumerate(sizes)))
    try:
        assert refused and sum(admitted) <= limit
        assert limit - sum(admitted) < max(refused)  # stopped within one reservation
        levels = (await a.reserve(scope(budget), 1)).budgets
        assert levels[0].used == sum(admitted) + (1 if sum(admitted) < limit else 0)
    finally:
        await a.close()
        await b.close()


async def test_a_gateway_restart_keeps_what_was_used(redis_port: int) -> None:
    day = scope(Budget("daily", "tokens", 1000))
    first = gateway(redis_port)
    spent = await first.reserve(day, 700)
    assert spent.reservation is not None
    await first.settle(spent.reservation, 600)
    dead = await first.reserve(day, 100)  # in flight when the gateway dies: never settled
    assert dead.admitted
    await first.close()
    restarted = gateway(redis_port)  # no state of its own: everything is in Redis
    try:
        refused = await restarted.reserve(day, 301)
        assert refused.exhausted is not None and refused.exhausted.used == 700
        assert (await restarted.reserve(day, 300)).admitted
    finally:
        await restarted.close()


async def test_redis_counters_roll_over_with_the_period(redis_port: int) -> None:
    wall = Wall()
    limiter = gateway(redis_port, wall)
    both = scope(Budget("daily", "cost", 1000), Budget("monthly", "tokens", 500))
    try:
        first = await limiter.reserve(both, 400, 900)
        assert first.admitted
        refused = await limiter.reserve(both, 50, 200)
        assert refused.exhausted is not None and refused.exhausted.budget.unit == "cost"
        wall.now += 3600  # a new day and a new month: both counters start again
        again = await limiter.reserve(both, 500, 1000)
        assert again.admitted and [lv.used for lv in again.budgets] == [1000, 500]
        wall.now -= 3600  # the old period's counters are still there (until they expire)
        old = await limiter.reserve(both, 1, 1)
        assert old.admitted and [lv.used for lv in old.budgets] == [901, 401]
        ttl = await limiter.client.ttl(limiter.budget_key(first.budgets[0].charge))
        assert 3600 < ttl <= 3600 + 86400  # it expires a day after its period
    finally:
        await limiter.close()


async def test_large_cost_counters_stay_exact(redis_port: int) -> None:
    """A 1e9 USD budget is 1e15 micro-USD: Redis answers integers, never `1e+15`."""
    limiter = gateway(redis_port)
    big = scope(Budget("monthly", "cost", 10**15))
    try:
        for expected in (10**14 + 3, 2 * (10**14 + 3)):
            decision = await limiter.reserve(big, 10, 10**14 + 3)
            assert decision.admitted and decision.budgets[0].used == expected
    finally:
        await limiter.close()
