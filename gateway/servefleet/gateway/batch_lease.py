"""Which gateway replica runs a batch: a lease per batch, so that of several replicas over one
batch store exactly one runs a given batch at a time, and another takes it over when that one
dies.

With Redis (the limits' Redis, `GatewayConfig.redis`) the lease is one key per batch,
`<key_prefix>:batch-lease:<batch id>`, holding its owner's random id with a TTL: taken only
when free (or already ours), renewed by its holder every third of the TTL, and released on a
graceful stop, each by one Lua script that checks the owner first. A holder that dies stops
renewing, so after the TTL another replica's next scan takes the batch and resumes after the
journaled lines. A renewal that fails (another owner, or Redis unreachable) means the lease
is lost: the holder takes no new line of that batch (lines in flight finish and are
journaled, once each by index).

Without Redis (one gateway, local mode) the lease is `LocalLease`: always held, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import AsyncIterator
from typing import Any, Protocol

log = logging.getLogger("servefleet.gateway.batches")

BATCH_LEASE_TTL_S = 15.0
"""How long a dead holder keeps its batches from the other replicas (renewed every third)."""
BATCH_LEASE_KEY = "{prefix}:batch-lease:{batch_id}"
"""The lease's Redis key, beside the limits' keys (`RedisConfig.key_prefix`)."""

# Take the lease if it is free or already ours (a renewal then); 1 when held.
ACQUIRE_LUA = """
local owner = redis.call('GET', KEYS[1])
if not owner then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
elseif owner == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
# Extend the lease only while it is still ours; 0: it expired or another replica holds it.
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# Delete the lease only while it is still ours (never another replica's).
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaseUnavailable(Exception):
    """Redis could not be reached: nobody can tell who runs a batch, so none is run."""


class BatchLease(Protocol):
    """Who runs which batch, among the gateway replicas over one store."""

    ttl_s: float
    shared: bool  # False: one gateway alone, nothing to renew

    async def acquire(self, batch_id: str) -> bool: ...
    async def renew(self, batch_id: str) -> bool: ...
    async def release(self, batch_id: str) -> None: ...


class LocalLease:
    """One gateway alone (no Redis): every batch is always its own."""

    ttl_s = float("inf")
    shared = False

    async def acquire(self, batch_id: str) -> bool:
        return True

    async def renew(self, batch_id: str) -> bool:
        return True

    async def release(self, batch_id: str) -> None:
        return None


class RedisBatchLease:
    """A lease per batch in the platform's Redis (`client`: a `redis.asyncio` client)."""

    shared = True

    def __init__(
        self,
        client: Any,
        *,
        key_prefix: str = "servefleet:limits",
        ttl_s: float = BATCH_LEASE_TTL_S,
        owner: str | None = None,
    ) -> None:
        self._client = client
        self._prefix = key_prefix
        self.ttl_s = ttl_s
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self.owner = owner or f"{socket.gethostname()}-{secrets.token_hex(8)}"
        self._acquire = client.register_script(ACQUIRE_LUA)
        self._renew = client.register_script(RENEW_LUA)
        self._release = client.register_script(RELEASE_LUA)

    def key(self, batch_id: str) -> str:
        return BATCH_LEASE_KEY.format(prefix=self._prefix, batch_id=batch_id)

    async def _run(self, script: Any, batch_id: str, *args: Any) -> int:
        try:
            return int(await script(keys=[self.key(batch_id)], args=[self.owner, *args]))
        except Exception as exc:  # redis raises many types: connection, timeout, response
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # a cancel the client turned into an
                raise asyncio.CancelledError from exc  # error: the stop goes on, not a pause
            raise LeaseUnavailable(str(exc)) from exc

    async def acquire(self, batch_id: str) -> bool:
        return await self._run(self._acquire, batch_id, self._ttl_ms) == 1

    async def renew(self, batch_id: str) -> bool:
        return await self._run(self._renew, batch_id, self._ttl_ms) == 1

    async def release(self, batch_id: str) -> None:
        await self._run(self._release, batch_id)


class Holding:
    """A lease this runner holds on one batch: renewed by its own task every third of the TTL
    (a batch's store calls may stall for longer than a poll); `lost` once a renewal fails."""

    def __init__(self, lease: BatchLease, batch_id: str) -> None:
        self.lease = lease
        self.batch_id = batch_id
        self.lost = asyncio.Event()
        self._stopping = False
        self._keeper: asyncio.Task[None] | None = None
        if lease.shared:
            self._keeper = asyncio.create_task(self._keep(), name=f"lease-{batch_id}")

    @property
    def held(self) -> bool:
        return not self.lost.is_set()

    async def _keep(self) -> None:
        while self.held and not self._stopping:
            await asyncio.sleep(self.lease.ttl_s / 3)
            await self.confirm()

    async def confirm(self) -> bool:
        """Renew now: True while the lease is still ours for a full TTL from now."""
        if not self.held:
            return False
        try:
            ours = await self.lease.renew(self.batch_id)
        except LeaseUnavailable as exc:
            log.warning("batch_lease_renew_failed id=%s error=%s", self.batch_id, exc)
            ours = False  # it may expire, and be taken, before we could tell
        if not ours:
            log.warning("batch_lease_lost id=%s: no new line of it runs here", self.batch_id)
            self.lost.set()
        return ours

    async def stop(self) -> None:
        """Stop renewing (the lease then expires unless released)."""
        self._stopping = True  # ends the loop even where a library swallows the cancel
        if self._keeper is not None:
            self._keeper.cancel()
            # wait, not `await keeper` under suppress(CancelledError): that would also swallow
            # a cancel of our own caller (the gateway stopping) landing meanwhile.
            await asyncio.wait([self._keeper])


@contextlib.asynccontextmanager
async def holding(lease: BatchLease, batch_id: str) -> AsyncIterator[Holding | None]:
    """The lease on `batch_id` for the block, or None when another replica holds it (raises
    `LeaseUnavailable` when Redis cannot say). Released when the block ends; when the block is
    cancelled it is not: a gateway stopping releases it after (`BatchRunner.release_leases`),
    one that dies leaves it to expire."""
    if not await lease.acquire(batch_id):
        yield None
        return
    hold = Holding(lease, batch_id)
    cancelled = False
    try:
        yield hold
    except asyncio.CancelledError:
        cancelled = True
        raise
    finally:
        await hold.stop()
        if hold.held and not cancelled:
            with contextlib.suppress(LeaseUnavailable):  # it expires after the TTL then
                await lease.release(batch_id)
