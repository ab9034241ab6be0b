"""A stream broken by its replica while every other replica is busy waits for a slot (ahead of
the queue) instead of being cut: the loss the engine_kill fault scenario found."""

from __future__ import annotations

import asyncio

from servefleet.api.gateway_config import GatewayDeployment, RoutingConfig
from servefleet.gateway.pool import DeploymentPool, Lease, PoolRequest
from servefleet.gateway.queueing import TrafficClass

R0, R1 = "http://r0", "http://r1"


def _pool(endpoints: list[str]) -> DeploymentPool:
    config = GatewayDeployment.model_validate(
        {
            "name": "d",
            "model": "m",
            "tenants": [{"name": "a"}],
            "pool": {"perReplicaConcurrency": 1},
            "admission": {"maxQueueDepth": 4, "maxQueueWait": 60},
        }
    )
    pool = DeploymentPool(config, RoutingConfig())
    pool.set_replicas(endpoints, ready=endpoints)
    return pool


async def _lease(pool: DeploymentPool) -> Lease:
    lease = await pool.acquire(PoolRequest("a", TrafficClass.INTERACTIVE, 1.0, 10, None))
    assert isinstance(lease, Lease)
    return lease


async def test_a_broken_stream_takes_the_next_freed_slot_before_the_queue() -> None:
    pool = _pool([R0, R1])
    first, second = await _lease(pool), await _lease(pool)
    broken, busy = (first, second) if first.replica.endpoint == R0 else (second, first)
    pool.eject(broken.replica)  # it died mid-stream
    queued = asyncio.ensure_future(_lease(pool))  # a new request, waiting in the queue
    resumed = asyncio.ensure_future(pool.reroute_waiting(broken, timeout_s=5))
    await asyncio.sleep(0.01)
    assert not resumed.done() and not queued.done()  # every other replica is busy
    assert broken.released  # its dead replica's slot is not held while it waits
    pool.release(busy, ok=True)
    moved = await asyncio.wait_for(resumed, 1)
    assert moved is not None and moved.replica.endpoint == R1
    assert not queued.done()  # the admitted stream went first
    pool.release(moved, ok=True)
    assert (await asyncio.wait_for(queued, 1)).replica.endpoint == R1


async def test_with_no_other_ready_replica_it_gives_up_at_once() -> None:
    pool = _pool([R0])
    broken = await _lease(pool)
    pool.eject(broken.replica)
    assert await asyncio.wait_for(pool.reroute_waiting(broken, timeout_s=30), 1) is None


async def test_the_wait_is_bounded_and_leaves_nothing_behind() -> None:
    pool = _pool([R0, R1])
    first, second = await _lease(pool), await _lease(pool)
    broken = first if first.replica.endpoint == R0 else second
    pool.eject(broken.replica)
    assert await pool.reroute_waiting(broken, timeout_s=0.05) is None
    assert len(pool.resuming) == 0
    assert pool.in_flight == 1  # only the busy replica's request
