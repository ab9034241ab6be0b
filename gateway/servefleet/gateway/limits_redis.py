"""Limits shared by every gateway replica through Redis.

`RedisLimiter` keeps the same buckets as `LocalLimiter` in Redis and changes them with one
atomic Lua script per step, on Redis' own clock, so every gateway replica agrees; budget
counters sit beside each scope's windows, one key per budget and period (`budgets`). It also
reads the shared levels without changing them, charges usage made elsewhere and gives budgets
refunds a failed settlement missed (`observe`, `debit`, `refund`): what
`limits_failover.FailoverLimiter` needs to carry limits across an outage.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from servefleet.gateway.budgets import BudgetCharge, BudgetLevel, Spend
from servefleet.gateway.limits import (
    LIMIT_NAMES,
    SECONDS_PER_DAY,
    LimitDecision,
    LimitScope,
    LimitSnapshot,
    Reservation,
    ScopeLevels,
    budget_charges,
)
from servefleet.gateway.limits_lua import (
    DEBIT_LUA,
    READ_LUA,
    REDIS_LEASE_TTL_S,
    REFUND_LUA,
    RENEW_LUA,
    RESERVE_LUA,
    SETTLE_LUA,
)


class RedisUnavailable(Exception):
    """Redis could not be reached or answered with an error."""


def _policy_args(scopes: Sequence[LimitScope]) -> list[Any]:
    """Each scope's three windows, as the Lua scripts read them (after their own arguments)."""
    args: list[Any] = []
    for scope in scopes:
        p = scope.policy
        args += [
            _limit_arg(p.requests_per_minute),
            _limit_arg(p.tokens_per_minute),
            _limit_arg(p.max_concurrent),
        ]
    return args


def _limit_arg(value: int | None) -> int:
    return 0 if value is None else int(value)


@dataclass(slots=True)
class Debt:
    """Requests and tokens a scope used without Redis (tokens < 0: a refund owed to it)."""

    scope: LimitScope
    requests: int = 0
    tokens: int = 0


def _levels(values: Sequence[Any]) -> ScopeLevels:
    """A scope's (requests level, tokens level) from a script; -1 is none."""
    rl, tl = (float(v) for v in values)
    return ScopeLevels(None if rl == -1 else rl, None if tl == -1 else tl)


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
        wall_clock: Callable[[], float] = time.time,
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
        self._wall = wall_clock  # names budget periods (Redis' TIME runs the windows)
        self.lease_ttl_s = lease_ttl_s
        self._lease_ttl_ms = int(lease_ttl_s * 1000)
        self._reserve = self._client.register_script(RESERVE_LUA)
        self._settle = self._client.register_script(SETTLE_LUA)
        self._renew = self._client.register_script(RENEW_LUA)
        self._read = self._client.register_script(READ_LUA)
        self._debit = self._client.register_script(DEBIT_LUA)
        self._refund = self._client.register_script(REFUND_LUA)
        self._leases: dict[str, list[str]] = {}  # reservation id -> the live sets it is in
        self._keys_cache: dict[str, list[str]] = {}

    @property
    def client(self) -> Any:
        """The Redis connection pool, for other shared counters (the spill-over cap)."""
        return self._client

    def _keys(self, scopes: Sequence[LimitScope]) -> list[str]:
        keys: list[str] = []
        for scope in scopes:
            cached = self._keys_cache.get(scope.key)
            if cached is None:
                base = self._base(scope.key)
                cached = [f"{base}:rpm", f"{base}:tpm", f"{base}:live"]
                if len(self._keys_cache) > 10000:
                    self._keys_cache.clear()
                self._keys_cache[scope.key] = cached
            keys.extend(cached)
        return keys

    def _base(self, scope_key: str) -> str:
        return f"{self._prefix}:{{{scope_key}}}"

    def budget_key(self, charge: BudgetCharge) -> str:
        """The counter of `charge`'s budget in its period (next to its scope's windows)."""
        return f"{self._base(charge.scope_key)}:{charge.name}"

    async def ping(self) -> None:
        try:
            await self._client.ping()
        except Exception as exc:  # redis raises many types: connection, timeout, response
            raise RedisUnavailable(str(exc)) from exc

    async def reserve(
        self, scopes: Sequence[LimitScope], tokens: int, micro_usd: int = 0
    ) -> LimitDecision:
        wall = self._wall()
        charges = budget_charges(scopes, Spend(tokens, micro_usd), wall)
        rid = uuid.uuid4().hex
        args: list[Any] = [tokens, rid, self._lease_ttl_ms, len(scopes), *_policy_args(scopes)]
        for charge in charges:  # a counter lives a day past its period's end
            expire = int(charge.resets_at - wall) + SECONDS_PER_DAY
            args += [charge.budget.limit, charge.amount, expire]
        keys = self._keys(scopes) + [self.budget_key(c) for c in charges]
        try:
            result = await self._reserve(keys=keys, args=args)
        except Exception as exc:
            raise RedisUnavailable(str(exc)) from exc
        exceeded, wait, broke = int(result[0]), float(result[1]), int(result[2])
        n = len(scopes)
        observed = tuple(_levels(result[3 + i * 2 : 5 + i * 2]) for i in range(n))
        used = [int(v) for v in result[3 + 2 * n :]]
        admitted = not exceeded and not broke
        budgets = tuple(BudgetLevel(c, u, admitted) for c, u in zip(charges, used, strict=True))
        snapshot = self._snapshot(scopes, observed[0] if observed else ScopeLevels())
        if broke:
            refused = [level for level in budgets if level.exhausted] or list(budgets)
            wait = max(level.charge.resets_at for level in refused) - wall
            return LimitDecision(False, snapshot, None, wait, "budget", observed, budgets)
        if exceeded:
            name = LIMIT_NAMES[exceeded - 1]
            return LimitDecision(False, snapshot, None, wait, name, observed, budgets)
        live = [keys[i * 3 + 2] for i, s in enumerate(scopes) if s.policy.max_concurrent]
        if live:
            self._leases[rid] = live
        reservation = Reservation(rid, tuple(scopes), tokens, self, charges)
        return LimitDecision(True, snapshot, reservation, observed=observed, budgets=budgets)

    async def observe(self, scopes: Sequence[LimitScope]) -> list[ScopeLevels]:
        """The shared window levels of `scopes` now, changing nothing (one round trip)."""
        if not scopes:
            return []
        try:
            result = await self._read(keys=self._keys(scopes), args=_policy_args(scopes))
        except Exception as exc:
            raise RedisUnavailable(str(exc)) from exc
        return [_levels(result[i * 2 : 2 + i * 2]) for i in range(len(scopes))]

    async def debit(self, debts: Sequence[Debt]) -> None:
        """Charge what was used without Redis to the shared windows (one round trip)."""
        if not debts:
            return
        keys: list[str] = []
        args: list[Any] = []
        for debt in debts:
            p = debt.scope.policy
            keys += self._keys([debt.scope])[:2]
            args += [
                _limit_arg(p.requests_per_minute),
                _limit_arg(p.tokens_per_minute),
                debt.requests,
                debt.tokens,
            ]
        try:
            await self._debit(keys=keys, args=args)
        except Exception as exc:
            raise RedisUnavailable(str(exc)) from exc

    async def refund(self, refunds: Sequence[tuple[BudgetCharge, int]]) -> None:
        """Give budgets back what settlements could not (one round trip)."""
        if not refunds:
            return
        keys = [self.budget_key(charge) for charge, _ in refunds]
        try:
            await self._refund(keys=keys, args=[back for _, back in refunds])
        except Exception as exc:
            raise RedisUnavailable(str(exc)) from exc

    def leases_on(self, scope: LimitScope) -> list[str]:
        """Ids of this gateway's live Redis reservations holding a slot of `scope`."""
        live = self._keys([scope])[2]
        return [rid for rid, keys in self._leases.items() if live in keys]

    async def settle(
        self, reservation: Reservation, used_tokens: int, used_micro_usd: int = 0
    ) -> None:
        if reservation.settled:
            return
        reservation.settled = True
        self._leases.pop(reservation.id, None)
        scopes = reservation.scopes
        args: list[Any] = [reservation.tokens - used_tokens, reservation.id, len(scopes)]
        for scope in scopes:
            p = scope.policy
            args += [_limit_arg(p.tokens_per_minute), _limit_arg(p.max_concurrent)]
        refunds = reservation.refunds(Spend(used_tokens, used_micro_usd))
        args += [back for _, back in refunds]
        keys = self._keys(scopes) + [self.budget_key(c) for c, _ in refunds]
        try:
            await self._settle(keys=keys, args=args)
        except Exception as exc:
            raise RedisUnavailable(str(exc)) from exc

    @staticmethod
    def _snapshot(scopes: Sequence[LimitScope], first: ScopeLevels) -> LimitSnapshot:
        if not scopes:
            return LimitSnapshot()
        req_level, tok_level = first.requests or 0.0, first.tokens or 0.0
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
