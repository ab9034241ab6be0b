"""The per-deployment spill-over rate cap: spilled requests per minute, as a token bucket.

Spill-over costs money at the hosted API, so the cap must hold for the whole gateway fleet, not
per replica: with `redis.url` set every gateway replica takes from one bucket in Redis (one Lua
script, Redis' own clock, the same approach as the tenant limits). While Redis is unreachable a
replica falls back to a local bucket holding its share (1/N) of the cap, and returns to the
shared bucket by itself.

Admission needs a synchronous yes/no to choose "spill" at all; that hint is `available()`, the
last state seen. The binding step is `take()`, atomic where the bucket lives; a spill whose
`take()` fails is handled like any request that may not spill (queue or shed).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("servefleet.gateway.spill")


class SpillBudget(Protocol):
    per_minute: int

    def available(self) -> bool: ...

    async def take(self) -> bool: ...


class LocalSpillBudget:
    """A token bucket in this process (no Redis, or Redis unreachable)."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._level = float(per_minute)
        self._stamp = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(
            float(self.per_minute), self._level + (now - self._stamp) * self.per_minute / 60.0
        )
        self._stamp = now

    def available(self) -> bool:
        self._refill()
        return self._level >= 1.0

    def take_now(self) -> bool:
        self._refill()
        if self._level < 1.0:
            return False
        self._level -= 1.0
        return True

    async def take(self) -> bool:
        return self.take_now()


# KEYS[1]: the bucket hash. ARGV: capacity per minute.
# Returns {taken (0/1), level after, Redis time}.
TAKE_LUA = """
local cap = tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local v = redis.call('HMGET', KEYS[1], 'l', 's')
local l = cap
if v[1] then
  l = tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60
  if l > cap then l = cap end
end
local taken = 0
if l >= 1 then
  l = l - 1
  taken = 1
end
redis.call('HSET', KEYS[1], 'l', l, 's', now)
redis.call('EXPIRE', KEYS[1], 120)
return {taken, tostring(l), tostring(now)}
"""


class RedisSpillBudget:
    """One bucket per deployment in Redis, shared by every gateway replica."""

    def __init__(
        self,
        client: Any,
        key: str,
        per_minute: int,
        *,
        share: float = 1.0,
        on_error: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        retry_s: float = 1.0,
    ) -> None:
        self.per_minute = per_minute
        self._key = key
        self._script = client.register_script(TAKE_LUA)
        self._clock = clock
        self._fallback = LocalSpillBudget(max(1, math.floor(per_minute * share)), clock)
        self._on_error = on_error or (lambda _op: None)
        self._retry_s = retry_s
        self._retry_at = 0.0
        self.degraded = False
        # The hint: when the shared bucket was last seen empty, it has a token again after
        # one refill interval. Answers may come back out of order (several connections), so
        # only the latest state by Redis' clock counts.
        self._empty_until = 0.0
        self._seen_at = float("-inf")

    def available(self) -> bool:
        if self.degraded and self._clock() < self._retry_at:
            return self._fallback.available()
        return self._clock() >= self._empty_until

    async def take(self) -> bool:
        now = self._clock()
        if self.degraded and now < self._retry_at:
            return self._fallback.take_now()
        try:
            taken, level, at = await self._script(keys=[self._key], args=[self.per_minute])
        except Exception as exc:  # redis raises many types: connection, timeout, response
            self._on_error("spill")
            if not self.degraded:
                log.warning(
                    "redis unreachable for the spill-over cap (%s); using a per-replica share",
                    exc,
                )
            self.degraded = True
            self._retry_at = now + self._retry_s
            return self._fallback.take_now()
        if self.degraded:
            log.warning("redis is back; the spill-over cap is shared again")
            self.degraded = False
        if float(at) >= self._seen_at:
            self._seen_at = float(at)
            missing = max(0.0, 1.0 - float(level))
            self._empty_until = now + missing * 60.0 / self.per_minute if missing else 0.0
        return bool(int(taken))
