"""Retry-After as a promise: spaced return times, honoured once, in a window, bounded."""

from __future__ import annotations

import asyncio

import pytest

from servefleet.api.gateway_config import GatewayDeployment, RoutingConfig
from servefleet.gateway.pool import DeploymentPool, Lease, PoolRequest, Shed
from servefleet.gateway.queueing import TrafficClass
from servefleet.gateway.retry_promises import EARLY_S, LATE_S, RetryPromises, retry_key


def test_refusals_at_one_instant_get_return_times_spaced_at_the_service_rate() -> None:
    promises = RetryPromises()
    waits = [promises.promise(bytes([i]), now=100.0, wait_s=1.0, rate=2.0) for i in range(6)]
    assert waits == pytest.approx([1.0, 1.5, 2.0, 2.5, 3.0, 3.5])
    # Later refusals queue after those already promised, never before them.
    assert promises.promise(b"late", now=101.0, wait_s=0.5, rate=2.0) == pytest.approx(3.0)


def test_a_retry_is_recognised_in_its_window_and_only_once() -> None:
    promises = RetryPromises()
    key = retry_key("acme", b'{"model": "m"}')
    wait = promises.promise(key, now=0.0, wait_s=4.0, rate=1.0)
    assert not promises.redeem(key, now=wait - EARLY_S - 0.1)  # too early
    assert not promises.redeem(retry_key("other", b'{"model": "m"}'), now=wait)  # another tenant
    assert promises.redeem(key, now=wait + 0.2)
    assert not promises.redeem(key, now=wait + 0.3)  # used


def test_a_retry_too_late_is_a_new_request() -> None:
    promises = RetryPromises()
    wait = promises.promise(b"k", now=0.0, wait_s=2.0, rate=1.0)
    assert not promises.redeem(b"k", now=wait + LATE_S + 0.1)
    assert len(promises) == 0  # expired and forgotten


def test_falling_due_counts_promises_not_yet_kept_within_the_horizon() -> None:
    promises = RetryPromises()
    for i in range(5):
        promises.promise(bytes([i]), now=0.0, wait_s=1.0, rate=1.0)  # due at 1, 2, 3, 4, 5
    assert promises.falling_due(now=0.0, within_s=1.0) == 2  # due 1 and 2 (one second early)
    assert promises.redeem(bytes([0]), now=1.0)
    assert promises.falling_due(now=1.0, within_s=1.0) == 2  # due 2 and 3; 1 was kept


def test_memory_is_bounded_under_any_overload() -> None:
    promises = RetryPromises(max_promises=3)
    waits = [promises.promise(bytes([i]), now=0.0, wait_s=1.0, rate=1.0) for i in range(5)]
    assert waits[:3] == [1.0, 2.0, 3.0]
    assert waits[3:] == [1.0, 1.0]  # past the cap: the plain prediction, nothing recorded
    assert len(promises) == 3


def test_the_key_is_tenant_and_body() -> None:
    assert retry_key("a", b"x") == retry_key("a", b"x")
    assert retry_key("a", b"x") != retry_key("b", b"x")
    assert retry_key("a", b"x") != retry_key("a", b"y")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _request(key: bytes) -> PoolRequest:
    return PoolRequest("a", TrafficClass.INTERACTIVE, 1.0, 10, None, retry_key=key)


async def test_the_pool_keeps_its_promise_to_a_returning_client_and_not_to_a_new_one() -> None:
    clock = Clock()
    config = GatewayDeployment.model_validate(
        {
            "name": "d",
            "model": "m",
            "tenants": [{"name": "a"}],
            "pool": {"perReplicaConcurrency": 1},
            "admission": {"maxQueueDepth": 1, "maxQueueWait": 60},
            "service_seconds": 1.0,
        }
    )
    pool = DeploymentPool(config, RoutingConfig(), clock=clock)
    pool.set_replicas(["http://r0"], ready=["http://r0"])
    busy = await pool.acquire(_request(b"busy"))
    assert isinstance(busy, Lease)
    queued = asyncio.ensure_future(pool.acquire(_request(b"queued")))
    await asyncio.sleep(0)
    first, second = await pool.acquire(_request(b"A")), await pool.acquire(_request(b"B"))
    assert isinstance(first, Shed) and isinstance(second, Shed)
    assert second.retry_after_s == pytest.approx(first.retry_after_s + 1.0)  # spaced, not equal

    clock.now += first.retry_after_s  # A comes back on time; the queue is still full
    returning = asyncio.ensure_future(pool.acquire(_request(b"A")))
    fresh = await pool.acquire(_request(b"C"))
    await asyncio.sleep(0)
    assert isinstance(fresh, Shed)  # a newcomer does not take the returning client's place
    assert not returning.done()  # A waits in the queue for a slot: admitted, not shed
    pool.release(busy, ok=True)
    pool.release(await queued, ok=True)  # type: ignore[arg-type]
    assert isinstance(await returning, Lease)
