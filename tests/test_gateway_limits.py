"""Limits: reservation and settlement, in process and through a real Redis, and Redis failover."""

from __future__ import annotations

import asyncio
import time

import pytest

from servefleet.bench.processes import free_port
from servefleet.gateway.budgets import Budget
from servefleet.gateway.limits import LimitPolicy, LimitScope, LocalLimiter, RequestTooLarge
from servefleet.gateway.limits_failover import FailoverLimiter
from servefleet.gateway.limits_redis import RedisLimiter
from tests.support.redis_server import start_redis

DAILY_100 = Budget("daily", "tokens", 100)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _scope(**kw: int) -> list[LimitScope]:
    return [LimitScope("t:acme", LimitPolicy(**kw))]


async def test_tokens_are_reserved_then_the_unused_part_is_given_back() -> None:
    clock = Clock()
    limiter = LocalLimiter(clock=clock, wall_clock=clock)
    scopes = _scope(tokens_per_minute=1000)
    first = await limiter.reserve(scopes, 600)
    assert first.admitted and first.snapshot.remaining_tokens == 400
    assert not (await limiter.reserve(scopes, 600)).admitted  # 600 > 400 left
    assert first.reservation is not None
    await limiter.settle(first.reservation, 100)  # only 100 were used: 500 come back
    second = await limiter.reserve(scopes, 600)
    assert second.admitted and second.snapshot.remaining_tokens == 300


async def test_windows_refill_and_429_says_when() -> None:
    clock = Clock()
    limiter = LocalLimiter(clock=clock, wall_clock=clock)
    scopes = _scope(requests_per_minute=2)
    assert (await limiter.reserve(scopes, 1)).admitted
    assert (await limiter.reserve(scopes, 1)).admitted
    refused = await limiter.reserve(scopes, 1)
    assert not refused.admitted and refused.exceeded == "requests_per_minute"
    assert refused.retry_after_s == pytest.approx(30.0)
    clock.now += 30.0
    assert (await limiter.reserve(scopes, 1)).admitted


async def test_concurrency_and_daily_budget() -> None:
    clock = Clock()
    limiter = LocalLimiter(clock=clock, wall_clock=clock)
    scopes = [LimitScope("t:acme", LimitPolicy(max_concurrent=1, budgets=(DAILY_100,)))]
    held = await limiter.reserve(scopes, 10)
    assert held.admitted and held.reservation is not None
    busy = await limiter.reserve(scopes, 10)
    assert busy.exceeded == "max_concurrent"
    await limiter.settle(held.reservation, 10)
    big = await limiter.reserve(scopes, 95)
    assert big.exceeded == "budget"
    with pytest.raises(RequestTooLarge):
        await limiter.reserve(_scope(tokens_per_minute=50), 51)


async def test_burst_of_20_with_room_for_5_admits_exactly_5_in_process() -> None:
    limiter = LocalLimiter()
    scopes = _scope(tokens_per_minute=500)
    decisions = await asyncio.gather(*(limiter.reserve(scopes, 100) for _ in range(20)))
    assert sum(d.admitted for d in decisions) == 5


# --- a real Redis ---------------------------------------------------------------------


async def test_redis_burst_of_20_admits_exactly_5_across_two_gateways(redis_port: int) -> None:
    url = f"redis://127.0.0.1:{redis_port}/0"
    # Two limiters = two gateway replicas sharing one window.
    one, two = RedisLimiter(url), RedisLimiter(url)
    scopes = _scope(tokens_per_minute=500)
    try:
        decisions = await asyncio.gather(
            *(limiter.reserve(scopes, 100) for limiter in [one, two] * 10)
        )
        admitted = [d for d in decisions if d.admitted]
        assert len(admitted) == 5
        assert all(d.retry_after_s > 0 for d in decisions if not d.admitted)
        # Settlement gives back what was not used: 5 x 80 unused -> 4 more fit.
        for decision in admitted:
            assert decision.reservation is not None
            await decision.reservation.limiter.settle(decision.reservation, 20)
        again = await asyncio.gather(*(one.reserve(scopes, 100) for _ in range(6)))
        assert sum(d.admitted for d in again) == 4
    finally:
        await one.close()
        await two.close()


async def test_redis_concurrency_slots_are_released(redis_port: int) -> None:
    limiter = RedisLimiter(f"redis://127.0.0.1:{redis_port}/0")
    scopes = _scope(max_concurrent=2)
    try:
        a, b = await limiter.reserve(scopes, 1), await limiter.reserve(scopes, 1)
        assert a.admitted and b.admitted
        assert (await limiter.reserve(scopes, 1)).exceeded == "max_concurrent"
        assert a.reservation is not None
        await limiter.settle(a.reservation, 1)
        assert (await limiter.reserve(scopes, 1)).admitted
    finally:
        await limiter.close()


async def test_redis_down_falls_back_to_per_replica_limits_and_recovers() -> None:
    port = free_port()
    errors: list[str] = []
    limiter = FailoverLimiter(
        RedisLimiter(f"redis://127.0.0.1:{port}/0", timeout_s=0.2),
        LocalLimiter(),
        share=0.5,  # two gateway replicas: each enforces half while Redis is away
        on_error=errors.append,
        min_backoff_s=0.05,
        max_backoff_s=0.05,
    )
    scopes = _scope(requests_per_minute=10)
    try:
        # Nothing listens on the port: served by the local fallback with half the limit.
        decisions = [await limiter.reserve(scopes, 1) for _ in range(7)]
        assert limiter.degraded and errors
        assert sum(d.admitted for d in decisions) == 5
        proc = start_redis(port)
        try:
            await asyncio.sleep(0.1)  # past the back-off
            decision = await limiter.reserve(scopes, 1)
            assert decision.admitted and not limiter.degraded
            assert decision.reservation is not None
            assert decision.reservation.limiter is limiter.primary
            # The full shared limit applies again: 10, of which the 5 used while Redis was away
            # (written back when it returned) and 1 now.
            more = [await limiter.reserve(scopes, 1) for _ in range(10)]
            assert sum(d.admitted for d in more) == 4
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    finally:
        await limiter.close()


async def test_limits_are_shared_again_when_redis_returns_without_any_request() -> None:
    """Recovery must not wait for traffic: with no request after Redis came back, the
    lease loop's ping clears the degraded state (the fault suite once saw the gauge stuck
    at 1 because the load ended inside the back-off)."""
    port = free_port()
    limiter = FailoverLimiter(
        RedisLimiter(f"redis://127.0.0.1:{port}/0", timeout_s=0.2, lease_ttl_s=30.0),
        LocalLimiter(),
        min_backoff_s=0.05,
        max_backoff_s=0.2,
    )
    await limiter.reserve(_scope(requests_per_minute=10), 1)  # nothing listens yet
    assert limiter.degraded
    task = asyncio.create_task(limiter.keep_leases())
    proc = start_redis(port)
    try:
        deadline = time.monotonic() + 5  # far under the 10 s lease renewal period
        while limiter.degraded and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not limiter.degraded and not task.done()
    finally:
        task.cancel()
        proc.terminate()
        proc.wait(timeout=10)
        await limiter.close()


# --- the spill-over rate cap ----------------------------------------------------------


async def test_spill_cap_is_one_bucket_for_two_gateways_in_redis(redis_port: int) -> None:
    import redis.asyncio as redis_asyncio

    from servefleet.gateway.spill_budget import RedisSpillBudget

    url = f"redis://127.0.0.1:{redis_port}/0"
    clients = [redis_asyncio.Redis.from_url(url), redis_asyncio.Redis.from_url(url)]
    budgets = [RedisSpillBudget(c, "spill:{d}", 3) for c in clients]
    try:
        assert all(b.available() for b in budgets)
        taken = await asyncio.gather(*(b.take() for b in budgets * 4))
        assert sum(taken) == 3  # 8 attempts from two gateways, 3 per minute for the fleet
        # Both learned the bucket is empty: admission stops choosing "spill" for a while.
        assert not any(b.available() for b in budgets)
    finally:
        for client in clients:
            await client.aclose()


async def test_spill_cap_falls_back_to_a_per_replica_share_without_redis() -> None:
    import redis.asyncio as redis_asyncio

    from servefleet.gateway.spill_budget import RedisSpillBudget

    port = free_port()
    client = redis_asyncio.Redis.from_url(
        f"redis://127.0.0.1:{port}/0", socket_connect_timeout=0.2, socket_timeout=0.2
    )
    errors: list[str] = []
    budget = RedisSpillBudget(client, "spill:{d}", 10, share=0.5, on_error=errors.append)
    try:
        taken = [await budget.take() for _ in range(7)]
        assert sum(taken) == 5 and budget.degraded and errors == ["spill"]
        proc = start_redis(port)
        try:
            await asyncio.sleep(1.05)  # past the retry back-off
            assert await budget.take() and not budget.degraded  # the shared bucket again
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    finally:
        await client.aclose()


def test_two_gateways_sharing_redis_spill_no_more_than_the_cap_over_http(redis_port: int) -> None:
    import httpx

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
    from servefleet.api.llmdeployment import SpilloverSpec
    from servefleet.bench.fake_upstream import FakeBehaviour, FakeOpenAI
    from servefleet.bench.processes import serve_in_thread
    from servefleet.gateway.app import Gateway

    hosted = FakeOpenAI(FakeBehaviour(require_key="hosted-key"))
    with serve_in_thread(hosted) as hosted_url:
        config = GatewayConfig(
            redis=RedisConfig(url=f"redis://127.0.0.1:{redis_port}/0", gateway_replicas=2),
            tenants=[GatewayTenant(name="a", api_keys=[ApiKeyRef(sha256=hash_api_key("key-a"))])],
            deployments=[
                GatewayDeployment(
                    name="d",
                    model="m",
                    tenants=[TenantAccess(name="a")],
                    # No replica and a long cold start: every request wants to spill.
                    cold_start_seconds=600.0,
                    spillover=SpilloverSpec.model_validate(
                        {
                            "enabled": True,
                            "baseURL": hosted_url + "/v1",
                            "model": "hosted-m",
                            "apiKeySecretRef": {"name": "s", "key": "k"},
                            "maxRequestsPerMinute": 2,
                        }
                    ),
                    spillover_api_key=SecretValueRef(env="HOSTED_KEY"),
                )
            ],
        )
        environ = {"HOSTED_KEY": "hosted-key"}
        with (
            serve_in_thread(Gateway(config, environ=environ)) as one,
            serve_in_thread(Gateway(config, environ=environ)) as two,
        ):
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            codes = [
                httpx.post(
                    base + "/v1/chat/completions",
                    json=body,
                    headers={"authorization": "Bearer key-a"},
                ).status_code
                for base in (one, two, one, two, one, two)
            ]
    assert codes.count(200) == 2 and codes.count(503) == 4  # 2 per minute for the fleet
    assert len(hosted.stats.requests) == 2


async def test_a_live_gateway_keeps_its_concurrency_slots_past_the_lease_ttl(
    redis_port: int,
) -> None:
    limiter = RedisLimiter(f"redis://127.0.0.1:{redis_port}/0", lease_ttl_s=1.0)
    scopes = _scope(max_concurrent=1)
    try:
        held = await limiter.reserve(scopes, 1)
        assert held.admitted
        for _ in range(8):  # renewed every 0.3 s for 2.4 s, over twice the TTL
            await asyncio.sleep(0.3)
            assert await limiter.renew_leases() == 1
        assert (await limiter.reserve(scopes, 1)).exceeded == "max_concurrent"
        assert held.reservation is not None
        await limiter.settle(held.reservation, 1)
        assert await limiter.renew_leases() == 0  # settled: nothing left to renew
        assert (await limiter.reserve(scopes, 1)).admitted
    finally:
        await limiter.close()


async def test_a_dead_gateways_slots_come_back_after_the_lease_ttl(redis_port: int) -> None:
    url = f"redis://127.0.0.1:{redis_port}/0"
    scopes = _scope(max_concurrent=2)
    dead, alive = RedisLimiter(url, lease_ttl_s=0.5), RedisLimiter(url, lease_ttl_s=1.0)
    try:
        assert (await dead.reserve(scopes, 1)).admitted  # then it dies: no settle, no renewal
        await dead.close()
        assert (await alive.reserve(scopes, 1)).admitted
        assert (await alive.reserve(scopes, 1)).exceeded == "max_concurrent"
        for _ in range(3):
            await asyncio.sleep(0.3)
            await alive.renew_leases()
        # The dead one's slot expired; the live one's was renewed and still counts.
        assert (await alive.reserve(scopes, 1)).admitted
        assert (await alive.reserve(scopes, 1)).exceeded == "max_concurrent"
    finally:
        await alive.close()


async def test_renewal_failures_degrade_the_limits_and_never_stop_the_loop() -> None:
    port = free_port()  # nothing listens: every renewal fails
    errors: list[str] = []
    primary = RedisLimiter(f"redis://127.0.0.1:{port}/0", timeout_s=0.2, lease_ttl_s=0.3)
    limiter = FailoverLimiter(primary, LocalLimiter(), on_error=errors.append)
    primary._leases["r"] = ["k"]  # one lease held, as after a reserve
    task = asyncio.create_task(limiter.keep_leases())
    try:
        while len(errors) < 2:  # two failed rounds: the loop went on after the first
            await asyncio.sleep(0.05)
        assert limiter.degraded and not task.done()
    finally:
        task.cancel()
        await primary.close()
