"""Broken streams waiting for a slot on another replica (mid-stream failover under load).

A stream whose replica died is continued on another one (`forward.Forwarder._continue`). When
every other ready replica is busy, giving up would cut an answer its client is half-way
through, so the stream waits for the next freed slot: ahead of the queue, as it was admitted
already, and for at most the deployment's upstream timeout (a stream may be silent that long
anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from servefleet.api.gateway_stats import ReplicaHealth
from servefleet.gateway.pool_types import Lease
from servefleet.gateway.routing import Replica

if TYPE_CHECKING:
    from servefleet.gateway.pool import DeploymentPool

Waiter = tuple["asyncio.Future[Lease]", Lease]  # (its lease to come, its broken replica's)


class ResumeWaiters:
    """The streams waiting, first come first served."""

    def __init__(self) -> None:
        self._waiting: deque[Waiter] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def serve(self, lease_elsewhere: Callable[[Lease], Lease | None]) -> None:
        """Hand free slots to waiting streams while there are both."""
        while self._waiting:
            future, broken = self._waiting[0]
            if future.done():
                self._waiting.popleft()
                continue
            moved = lease_elsewhere(broken)
            if moved is None:
                return
            self._waiting.popleft()
            future.set_result(moved)

    async def wait(self, pool: DeploymentPool, broken: Lease, timeout_s: float) -> Lease | None:
        future: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        entry: Waiter = (future, broken)
        self._waiting.append(entry)
        pool.pump()
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            if _holds_lease(future):
                return future.result()  # handed over at the moment the wait ran out
            future.cancel()
            return None
        except asyncio.CancelledError:
            if _holds_lease(future):
                pool.release(future.result(), ok=True)
            future.cancel()
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiting.remove(entry)


async def reroute_waiting(pool: DeploymentPool, broken: Lease, timeout_s: float) -> Lease | None:
    """`pool.reroute` for a stream its replica broke: when other replicas are ready but all
    busy, wait for one of their slots instead of giving up; None when there is none."""
    moved = pool.reroute(broken)
    if moved is not None or not others_ready(pool, broken.replica):
        return moved
    pool.release(broken, ok=False)
    return await pool.resuming.wait(pool, broken, timeout_s)


def others_ready(pool: DeploymentPool, replica: Replica) -> bool:
    """Whether a replica other than `replica` is ready (busy or not)."""
    others = (r for r in pool.replicas.replicas.values() if r is not replica)
    return any(r.state is ReplicaHealth.READY for r in others)


def _holds_lease(future: asyncio.Future[Lease]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None
