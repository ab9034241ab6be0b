"""Limits shared by every gateway replica through Redis, with a local fallback.

`RedisLimiter` keeps the same buckets as `LocalLimiter` in Redis and changes them with one
atomic Lua script per step, on Redis' own clock, so every gateway replica agrees.
`FailoverLimiter` uses it while Redis answers and, while it does not, enforces each replica's
share (1/N) of every limit locally, returning to Redis by itself after a back-off.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from servefleet.gateway.limits import (
    LIMIT_NAMES,
    SECONDS_PER_DAY,
    LimitDecision,
    LimitPolicy,
    LimitScope,
    LimitSnapshot,
    LocalLimiter,
    Reservation,
    check_request_size,
)
from servefleet.gateway.limits_lua import REDIS_LEASE_TTL_S, RENEW_LUA, RESERVE_LUA, SETTLE_LUA

log = logging.getLogger("servefleet.gateway.limits")


class RedisUnavailable(Exception):
    """Redis could not be reached or answered with an error."""


def _limit_arg(value: int | None) -> int:
    return 0 if value is None else int(value)


class RedisLimiter:
    """Limits shared by every gateway replica: one round trip and one Lua script per step."""

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "servefleet:limits",
        timeout_s: float = 0.5,
        lease_ttl_s: float = REDIS_LEASE_TTL_S,
    ) -> None:
        import redis.asyncio as redis_asyncio

        self._client: Any = redis_asyncio.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._prefix = key_prefix
        self.lease_ttl_s = lease_ttl_s
        self._lease_ttl_ms = int(lease_ttl_s * 1000)
        self._reserve = self._client.register_script(RESERVE_LUA)
        self._settle = self._client.register_script(SETTLE_LUA)
        self._renew = self._client.register_script(RENEW_LUA)
        self._leases: dict[str, list[str]] = {}  # reservation id -> the live sets it is in
        self._keys_cache: dict[tuple[str, int], list[str]] = {}

    @property
    def client(self) -> Any:
        """The Redis connection pool, for other shared counters (the spill-over cap)."""
        return self._client

    def _keys(self, scopes: Sequence[LimitScope], day: int) -> list[str]:
        keys: list[str] = []
        for scope in scopes:
            cached = self._keys_cache.get((scope.key, day))
            if cached is None:
                base = f"{self._prefix}:{{{scope.key}}}"
                cached = [f"{base}:rpm", f"{base}:tpm", f"{base}:live", f"{base}:day:{day}"]
                if len(self._keys_cache) > 10000:
                    self._keys_cache.clear()
                self._keys_cache[(scope.key, day)] = cached
            keys.extend(cached)
        return keys

    async def ping(self) -> None:
        try:
            await self._client.ping()
        except Exception as exc:  # redis raises many types: connection, timeout, response
            raise RedisUnavailable(str(exc)) from exc

    async def reserve(self, scopes: Sequence[LimitScope], tokens: int) -> LimitDecision:
        check_request_size(scopes, tokens)
        rid = uuid.uuid4().hex
        day = int(time.time() // SECONDS_PER_DAY)
        args: list[Any] = [tokens, rid, self._lease_ttl_ms]
        for scope in scopes:
            p = scope.policy
            args += [
                _limit_arg(p.requests_per_minute),
                _limit_arg(p.tokens_per_minute),
                _limit_arg(p.max_concurrent),
                _limit_arg(p.daily_tokens),
            ]
        keys = self._keys(scopes, day)
        try:
            result = await self._reserve(keys=keys, args=args)
        except Exception as exc:
            raise RedisUnavailable(str(exc)) from exc
        exceeded, wait, req_level, tok_level, redis_day = (
            int(result[0]),
            float(result[1]),
            float(result[2]),
            float(result[3]),
            int(result[4]),
        )
        snapshot = self._snapshot(scopes, req_level, tok_level)
        if exceeded:
            return LimitDecision(False, snapshot, None, wait, LIMIT_NAMES[exceeded - 1])
        if redis_day != day:  # the day turned between our clock and Redis' clock
            day = redis_day
        live = [keys[i * 4 + 2] for i, s in enumerate(scopes) if s.policy.max_concurrent]
        if live:
            self._leases[rid] = live
        return LimitDecision(True, snapshot, Reservation(rid, tuple(scopes), tokens, day, self))

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        if reservation.settled:
            return
        reservation.settled = True
        self._leases.pop(reservation.id, None)
        args: list[Any] = [reservation.tokens - used_tokens, reservation.id]
        for scope in reservation.scopes:
            p = scope.policy
            args += [
                0,
                _limit_arg(p.tokens_per_minute),
                _limit_arg(p.max_concurrent),
                _limit_arg(p.daily_tokens),
            ]
        try:
            await self._settle(keys=self._keys(reservation.scopes, reservation.day), args=args)
        except Exception as exc:
            raise RedisUnavailable(str(exc)) from exc

    @staticmethod
    def _snapshot(
        scopes: Sequence[LimitScope], req_level: float, tok_level: float
    ) -> LimitSnapshot:
        if not scopes:
            return LimitSnapshot()
        p = scopes[0].policy
        rpm, tpm = p.requests_per_minute, p.tokens_per_minute
        return LimitSnapshot(
            rpm,
            None if rpm is None else max(0, int(req_level)),
            0.0 if rpm is None else (rpm - max(0.0, req_level)) * 60.0 / rpm,
            tpm,
            None if tpm is None else max(0, int(tok_level)),
            0.0 if tpm is None else (tpm - tok_level) * 60.0 / tpm,
        )

    async def renew_leases(self) -> int:
        """Extend every concurrency lease this gateway holds by a full TTL, in one round trip;
        returns how many were renewed."""
        keys = [key for live in self._leases.values() for key in live]
        if not keys:
            return 0
        rids = [rid for rid, live in self._leases.items() for _ in live]
        try:
            await self._renew(keys=keys, args=[self._lease_ttl_ms, *rids])
        except Exception as exc:
            raise RedisUnavailable(str(exc)) from exc
        return len(keys)

    async def close(self) -> None:
        await self._client.aclose()


class FailoverLimiter:
    """Redis first; while Redis is unreachable, per-replica local limits. Recovers by itself.

    While degraded every replica enforces `share` of each limit locally (share = 1 / number of
    gateway replicas), so the fleet as a whole stays near the configured limits. Redis is retried
    after a back-off that doubles up to `max_backoff_s`.
    """

    def __init__(
        self,
        primary: RedisLimiter,
        fallback: LocalLimiter,
        *,
        share: float = 1.0,
        on_error: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        min_backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self._share = share
        self._on_error = on_error or (lambda _op: None)
        self._clock = clock
        self._min_backoff = min_backoff_s
        self._max_backoff = max_backoff_s
        self._backoff = min_backoff_s
        self._retry_at = 0.0
        self.degraded = False
        self._scaled: dict[LimitPolicy, LimitPolicy] = {}

    def _local_scopes(self, scopes: Sequence[LimitScope]) -> list[LimitScope]:
        out = []
        for scope in scopes:
            scaled = self._scaled.get(scope.policy)
            if scaled is None:
                scaled = self._scaled[scope.policy] = scope.policy.scaled(self._share)
            out.append(LimitScope(scope.key, scaled))
        return out

    def _failed(self, op: str, exc: Exception) -> None:
        self._on_error(op)
        if not self.degraded:
            log.warning(
                "redis unreachable (%s: %s); enforcing per-replica limits (share %.2f) until "
                "it is back",
                op,
                exc,
                self._share,
            )
        else:
            self._backoff = min(self._max_backoff, self._backoff * 2)
        self.degraded = True
        self._retry_at = self._clock() + self._backoff

    async def reserve(self, scopes: Sequence[LimitScope], tokens: int) -> LimitDecision:
        if not self.degraded or self._clock() >= self._retry_at:
            try:
                decision = await self.primary.reserve(scopes, tokens)
            except RedisUnavailable as exc:
                self._failed("reserve", exc)
            else:
                self._recovered()
                return decision
        return self.fallback.reserve_now(self._local_scopes(scopes), tokens)

    def _recovered(self) -> None:
        if self.degraded:
            log.warning("redis is back; limits are shared across replicas again")
            self.degraded = False
            self._backoff = self._min_backoff

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        # Settle where the reservation was made; the fallback's scopes are already scaled.
        if reservation.limiter is self.fallback:
            self.fallback.settle_now(reservation, used_tokens)
            return
        try:
            await self.primary.settle(reservation, used_tokens)
        except RedisUnavailable as exc:
            # The concurrency lease expires on its own; the token refund is lost (conservative).
            self._failed("settle", exc)

    async def keep_leases(self) -> None:
        """Renew this gateway's concurrency leases in Redis for as long as it runs (a task the
        gateway starts and cancels); an unreachable Redis is one more failure, never the end.
        While degraded it also pings Redis each time the back-off ends, so the limits are
        shared again as soon as Redis is back, whether or not requests arrive to notice."""
        renew_every = self.primary.lease_ttl_s / 3
        since_renewal = 0.0
        while True:
            step = renew_every - since_renewal
            if self.degraded:
                step = min(step, self._min_backoff)
            await asyncio.sleep(step)
            since_renewal += step
            if self.degraded and self._clock() >= self._retry_at:
                await self._probe()
            if since_renewal >= renew_every:
                since_renewal = 0.0
                try:
                    await self.primary.renew_leases()
                except RedisUnavailable as exc:
                    self._failed("renew", exc)

    async def _probe(self) -> None:
        try:
            await self.primary.ping()
        except RedisUnavailable as exc:
            self._failed("ping", exc)
        else:
            self._recovered()

    async def close(self) -> None:
        await self.primary.close()
