"""A queued request's wait for a replica slot: pushed into the fair queue, woken by the
pool's `pump` with a lease, pushed out by a higher-priority request, or shed past
`maxQueueWait`. Apart from `pool` so the waiting rules read on their own; the pool hands
itself in as a `QueueHost`."""

from __future__ import annotations

import asyncio
from typing import Protocol

from servefleet.gateway.pool_resume import holds_lease
from servefleet.gateway.pool_types import Lease, PoolRequest, Shed
from servefleet.gateway.queueing import FairQueue


class ShedWhileQueued(Exception):
    """Wakes a queued request that was pushed out (or found no replica)."""

    def __init__(self, shed: Shed) -> None:
        super().__init__(shed.reason)
        self.shed = shed


class QueueHost(Protocol):
    """What a wait needs of its pool."""

    queue: FairQueue

    def now(self) -> float: ...
    def pump(self) -> None: ...
    def refuse(self, request: PoolRequest, wait_s: float, reason: str) -> Shed: ...
    def retry_after(self, now: float) -> float: ...
    def release(self, lease: Lease, *, ok: bool) -> None: ...
    def granted(self, request: PoolRequest, lease: Lease) -> None: ...


def make_room(pool: QueueHost, request: PoolRequest, now: float) -> Shed | None:
    """Push out a lower-priority request when the queue is full; a Shed when none can go."""
    queue = pool.queue
    victim = queue.make_room(request.tenant, request.traffic_class)
    if victim is None:
        return pool.refuse(request, pool.retry_after(now), "queue full")
    queue.cancel(victim)
    if victim.future is not None and not victim.future.done():
        shed = Shed(pool.retry_after(now), "pushed out by a higher-priority request")
        victim.future.set_exception(ShedWhileQueued(shed))
    return None


async def wait_for_slot(
    pool: QueueHost, request: PoolRequest, max_wait_s: float, promised: bool = False
) -> Lease | Shed:
    """Queue the request until `pump` hands it a replica, or shed it past `max_wait_s`."""
    loop = asyncio.get_running_loop()
    now = pool.now()
    queue = pool.queue
    if not promised and queue.full and (refused := make_room(pool, request, now)):
        return refused
    future: asyncio.Future[Lease] = loop.create_future()
    entry = queue.push(
        request.tenant,
        request.traffic_class,
        request.tokens,
        now,
        weight=request.weight,
        future=future,
        payload=request,
        promised=promised,
    )
    pool.pump()
    try:
        lease = await asyncio.wait_for(asyncio.shield(future), timeout=max_wait_s)
    except ShedWhileQueued as pushed_out:
        return pushed_out.shed
    except TimeoutError:
        if not holds_lease(future):
            queue.cancel(entry)
            future.cancel()
            return pool.refuse(request, pool.retry_after(pool.now()), "waited past maxQueueWait")
        lease = future.result()  # dispatched at the very moment the wait ran out
    except asyncio.CancelledError:
        # The client went away while queued: give the slot back if one was handed over.
        if holds_lease(future):
            pool.release(future.result(), ok=True)
        else:
            queue.cancel(entry)
            future.cancel()
        raise
    lease.queue_wait_s = pool.now() - entry.enqueued_at
    pool.granted(request, lease)
    return lease
