"""Limits shared by every gateway replica through Redis.

`RedisLimiter` keeps the same buckets as `LocalLimiter` in Redis and changes them with one
atomic Lua script per step, on Redis' own clock, so every gateway replica agrees. It also
reads the shared levels without changing them and charges usage made elsewhere (`observe`,
`debit`): what `limits_failover.FailoverLimiter` needs to carry limits across an outage.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from servefleet.gateway.limits import (
    LIMIT_NAMES,
    SECONDS_PER_DAY,
    LimitDecision,
    LimitScope,
    LimitSnapshot,
    Reservation,
    ScopeLevels,
    check_request_size,
)
from servefleet.gateway.limits_lua import (
    DEBIT_LUA,
    READ_LUA,
    REDIS_LEASE_TTL_S,
    RENEW_LUA,
    RESERVE_LUA,
    SETTLE_LUA,
)


class RedisUnavailable(Exception):
    """Redis could not be reached or answered with an error."""


def _policy_args(scopes: Sequence[LimitScope]) -> list[Any]:
    """Each scope's four limits, as the Lua scripts read them (after their own arguments)."""
    args: list[Any] = []
    for scope in scopes:
        p = scope.policy
        args += [
            _limit_arg(p.requests_per_minute),
            _limit_arg(p.tokens_per_minute),
            _limit_arg(p.max_concurrent),
            _limit_arg(p.daily_tokens),
        ]
    return args


def _limit_arg(value: int | None) -> int:
    return 0 if value is None else int(value)


@dataclass(slots=True)
class Debt:
    """Requests and tokens a scope used without Redis (tokens < 0: a refund owed to it)."""

    scope: LimitScope
    day: int
    requests: int = 0
    tokens: int = 0


def _levels(values: Sequence[Any], day: int) -> ScopeLevels:
    """A scope's (requests level, tokens level, daily used) from a script; -1 is none."""
    rl, tl, du = (float(v) for v in values)
    return ScopeLevels(
        None if rl == -1 else rl,
        None if tl == -1 else tl,
        None if du < 0 else int(du),
        day,
    )


class RedisLimiter:
    """Limits shared by every gateway replica: one round trip and one Lua script per step."""

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "servefleet:limits",
        timeout_s: float = 0.5,
        lease_ttl_s: float = REDIS_LEASE_TTL_S,
        password: str | None = None,
    ) -> None:
        import redis.asyncio as redis_asyncio

        self._client: Any = redis_asyncio.Redis.from_url(
            url,
            password=password,  # a password in `url` wins
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
        self._read = self._client.register_script(READ_LUA)
        self._debit = self._client.register_script(DEBIT_LUA)
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
        args: list[Any] = [tokens, rid, self._lease_ttl_ms, *_policy_args(scopes)]
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
        observed = tuple(
            _levels(result[5 + i * 3 : 8 + i * 3], redis_day) for i in range(len(scopes))
        )
        if exceeded:
            return LimitDecision(
                False, snapshot, None, wait, LIMIT_NAMES[exceeded - 1], observed=observed
            )
        if redis_day != day:  # the day turned between our clock and Redis' clock
            day = redis_day
        live = [keys[i * 4 + 2] for i, s in enumerate(scopes) if s.policy.max_concurrent]
        if live:
            self._leases[rid] = live
        reservation = Reservation(rid, tuple(scopes), tokens, day, self)
        return LimitDecision(True, snapshot, reservation, observed=observed)

    async def observe(self, scopes: Sequence[LimitScope]) -> list[ScopeLevels]:
        """The shared levels of `scopes` now, changing nothing (one round trip)."""
        if not scopes:
            return []
        day = int(time.time() // SECONDS_PER_DAY)
        try:
            result = await self._read(keys=self._keys(scopes, day), args=_policy_args(scopes))
        except Exception as exc:
            raise RedisUnavailable(str(exc)) from exc
        redis_day = int(result[0])
        return [_levels(result[1 + i * 3 : 4 + i * 3], redis_day) for i in range(len(scopes))]

    async def debit(self, debts: Sequence[Debt]) -> None:
        """Charge what was used without Redis to the shared windows and days (one round trip)."""
        if not debts:
            return
        keys: list[str] = []
        args: list[Any] = []
        for debt in debts:
            p = debt.scope.policy
            keys += self._keys([debt.scope], debt.day)
            args += [
                _limit_arg(p.requests_per_minute),
                _limit_arg(p.tokens_per_minute),
                _limit_arg(p.daily_tokens),
                debt.requests,
                debt.tokens,
            ]
        try:
            await self._debit(keys=keys, args=args)
        except Exception as exc:
            raise RedisUnavailable(str(exc)) from exc

    def leases_on(self, scope: LimitScope) -> list[str]:
        """Ids of this gateway's live Redis reservations holding a slot of `scope`."""
        live = self._keys([scope], 0)[2]
        return [rid for rid, keys in self._leases.items() if live in keys]

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
