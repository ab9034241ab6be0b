"""A Redis outage hands no tenant a second window or a second budget (real redis-server).

Redis is killed and started again on the same port with its data kept (append-only file), as
a crashed and restarted server would be. During the outage each gateway replica's local
windows start from its share of the shared levels it last saw; afterwards what it used is
written back. Budgets are not spent at all while Redis is away (`limits_failover`), so the
rule is exact: the budget holds across the outage, on every replica together.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from servefleet.bench.processes import free_port
from servefleet.gateway.budgets import Budget
from servefleet.gateway.limits import LimitDecision, LimitPolicy, LimitScope, LocalLimiter
from servefleet.gateway.limits_failover import FailoverLimiter
from servefleet.gateway.limits_redis import RedisLimiter
from tests.support.redis_server import start_redis

DAILY = 1000
REDIS_TIMEOUT_S = 2.0
DAY = (Budget("daily", "tokens", DAILY),)


@dataclass
class Redis:
    port: int
    data: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = start_redis(self.port, self.data)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    server = Redis(free_port(), tmp_path)
    server.start()
    yield server
    server.kill()


def limiter(redis: Redis, share: float = 1.0, lease_ttl_s: float = 30.0) -> FailoverLimiter:
    # A killed server refuses connections at once, so the timeout only bounds a slow one: the
    # server syncs every write to disk, which took over 0.2 s on a busy CI machine.
    return FailoverLimiter(
        RedisLimiter(redis.url, timeout_s=REDIS_TIMEOUT_S, lease_ttl_s=lease_ttl_s),
        LocalLimiter(),
        share=share,
        min_backoff_s=0.05,
        max_backoff_s=0.05,
    )


@pytest.fixture
async def one(redis: Redis) -> AsyncIterator[FailoverLimiter]:
    made = limiter(redis)
    yield made
    await made.close()


def scopes(**policy: Any) -> list[LimitScope]:
    return [LimitScope("t:acme", LimitPolicy(**policy))]


async def spend(limiter: FailoverLimiter, tokens: int, **policy: Any) -> LimitDecision:
    """Reserve `tokens` and, when admitted, settle having used all of them."""
    decision = await limiter.reserve(scopes(**policy), tokens)
    if decision.reservation is not None:
        await limiter.settle(decision.reservation, tokens)
    return decision


async def admitted_in_steps(limiter: FailoverLimiter, step: int, **policy: Any) -> int:
    """Tokens admitted in `step`-sized requests until one is refused."""
    total = 0
    while (await spend(limiter, step, **policy)).admitted:
        total += step
    return total


async def test_budgets_are_not_spent_while_redis_is_away(
    redis: Redis, one: FailoverLimiter
) -> None:
    assert (await spend(one, 800, budgets=DAY)).admitted  # through Redis
    redis.kill()
    refused = await spend(one, 100, budgets=DAY)  # Redis is away: not spent blind
    assert one.degraded
    assert not refused.admitted and refused.exceeded == "budget_unavailable"
    assert refused.retry_after_s > 0
    # A tenant without a budget is still served from its local windows.
    assert (await spend(one, 100, tokens_per_minute=6000)).admitted
    redis.start()
    await asyncio.sleep(0.1)  # past the back-off
    assert (await spend(one, 150, budgets=DAY)).admitted  # 200 were left: exactly that
    assert not one.degraded
    assert not (await spend(one, 100, budgets=DAY)).admitted
    assert (await spend(one, 50, budgets=DAY)).admitted
    refused = await spend(one, 1, budgets=DAY)
    assert not refused.admitted and refused.exceeded == "budget"


async def test_an_outage_starts_from_the_shared_minute_window(
    redis: Redis, one: FailoverLimiter
) -> None:
    tpm = 6000  # refills 100 tokens a second
    assert (await spend(one, 5000, tokens_per_minute=tpm)).admitted
    redis.kill()
    # About 1,000 left (plus what refilled since): a fresh window would have held 6,000.
    admitted = await admitted_in_steps(one, 100, tokens_per_minute=tpm)
    assert one.degraded
    assert 1000 <= admitted <= 1600, admitted


async def test_refunds_redis_missed_are_written_back(redis: Redis, one: FailoverLimiter) -> None:
    decision = await one.reserve(scopes(budgets=DAY), 600)  # Redis: 600 of the day
    assert decision.reservation is not None
    redis.kill()
    await one.settle(decision.reservation, 100)  # used 100; Redis cannot hear the refund
    assert one.degraded
    redis.start()
    await asyncio.sleep(0.1)
    # 600 reserved - 500 refunded = 100 of the day used: 900 left, not 400.
    assert await admitted_in_steps(one, 100, budgets=DAY) == 900


async def test_two_replicas_never_double_a_daily_budget(redis: Redis) -> None:
    """The issue's attack: spend the day, wait for an outage, spend it again on every replica,
    and once more when Redis is back. Now: the day holds, across both replicas and after."""
    a, b = limiter(redis, 0.5, lease_ttl_s=0.3), limiter(redis, 0.5, lease_ttl_s=0.3)
    loops = [asyncio.create_task(x.keep_leases()) for x in (a, b)]
    try:
        assert (await spend(a, 200, budgets=DAY)).admitted
        assert (await spend(b, 200, budgets=DAY)).admitted
        redis.kill()
        during = sum([await admitted_in_steps(x, 50, budgets=DAY) for x in (a, b)])
        assert a.degraded and b.degraded
        assert during == 0  # neither replica can see what the other spends
        redis.start()
        await asyncio.sleep(0.3)  # the lease loops ping it
        after = sum([await admitted_in_steps(x, 50, budgets=DAY) for x in (a, b)])
        assert not a.degraded and not b.degraded
        assert 400 + during + after == DAILY
    finally:
        for task in loops:
            task.cancel()
        await a.close()
        await b.close()


async def test_slots_held_in_redis_count_during_an_outage(
    redis: Redis, one: FailoverLimiter
) -> None:
    held = await one.reserve(scopes(max_concurrent=2), 1)
    assert held.admitted and held.reservation is not None
    redis.kill()
    first = await one.reserve(scopes(max_concurrent=2), 1)
    assert first.admitted and one.degraded
    assert (await one.reserve(scopes(max_concurrent=2), 1)).exceeded == "max_concurrent"
    await one.settle(held.reservation, 1)  # the slot held in Redis comes back
    assert (await one.reserve(scopes(max_concurrent=2), 1)).admitted
