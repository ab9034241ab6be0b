"""Broken streams waiting for a slot on another replica (mid-stream failover under load).

A stream whose replica died is continued on another one (`forward.Forwarder._continue`). When
every other ready replica is busy, giving up would cut an answer its client is half-way
through, so the stream waits for the next freed slot: ahead of the queue, as it was admitted
already, and for at most the deployment's upstream timeout (a stream may be silent that long
anyway). The pool owns the waiters (`DeploymentPool.reroute_waiting`) and drives them with
callbacks: this module knows leases, not the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

from servefleet.gateway.pool_types import Lease

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

    async def wait(
        self,
        broken: Lease,
        timeout_s: float,
        *,
        pump: Callable[[], None],
        release: Callable[[Lease], None],
    ) -> Lease | None:
        """A lease elsewhere for `broken`'s request, handed over by `serve` (which `pump`
        calls when slots free); None after `timeout_s`. A lease handed over to a waiter that
        is cancelled goes back through `release`."""
        future: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        entry: Waiter = (future, broken)
        self._waiting.append(entry)
        pump()
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            if holds_lease(future):
                return future.result()  # handed over at the moment the wait ran out
            future.cancel()
            return None
        except asyncio.CancelledError:
            if holds_lease(future):
                release(future.result())
            future.cancel()
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiting.remove(entry)


def holds_lease(future: asyncio.Future[Lease]) -> bool:
    """Whether a waiter's future was handed a lease (not cancelled, not failed)."""
    return future.done() and not future.cancelled() and future.exception() is None
