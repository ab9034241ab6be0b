"""Per-tenant limits: reserve at admission, settle when the response ends.

Tokens are *reserved* (prompt + max_tokens) before a request is dispatched and the unused part
is given back at the end, so bursts and long streams cannot overshoot a tenant's window.
Request and token windows are token buckets holding one minute of allowance that refill
continuously (OpenAI's own semantics); budgets (`budgets`: tokens or cost per UTC day or month)
are counters per period, charged the same way; concurrency is a set of live reservation ids
whose leases expire, so a crashed gateway cannot leak slots.

One interface, three implementations: `LocalLimiter` (here, in process), and in
`limits_redis` `RedisLimiter` (shared by every gateway replica through atomic Lua scripts) and
in `limits_failover` `FailoverLimiter` (Redis, falling back to per-replica local limits seeded
from the shared ones while Redis is unreachable, writing back what they used when it returns).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from servefleet.gateway.budgets import (
    SECONDS_PER_DAY,
    Budget,
    BudgetCharge,
    BudgetLevel,
    Spend,
    charges_for,
)

__all__ = ["SECONDS_PER_DAY", "Spend"]
# How long an in-process concurrency slot survives without being settled. It dies with its
# process, so it needs no renewal (the shared slots in Redis are renewed leases, `limits_lua`);
# this only bounds a slot that a bug left unsettled in a live gateway.
DEFAULT_LEASE_TTL_S = 900.0


@dataclass(frozen=True, slots=True)
class LimitPolicy:
    """The numbers of one scope; `None` means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    budgets: tuple[Budget, ...] = ()

    def scaled(self, share: float) -> LimitPolicy:
        """This policy's windows divided among `1/share` gateway replicas (at least 1 of
        everything); budgets are never divided: without Redis they are not spent at all."""

        def part(value: int | None) -> int | None:
            return None if value is None else max(1, math.floor(value * share))

        return LimitPolicy(
            part(self.requests_per_minute),
            part(self.tokens_per_minute),
            part(self.max_concurrent),
            self.budgets,
        )


@dataclass(frozen=True, slots=True)
class LimitScope:
    """One set of counters: a tenant, or a tenant on one model."""

    key: str
    policy: LimitPolicy


@dataclass(frozen=True, slots=True)
class LimitSnapshot:
    """What the `x-ratelimit-*` headers say (for the first, i.e. the tenant's, scope)."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float = 0.0
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float = 0.0


@dataclass(slots=True)
class Reservation:
    id: str
    scopes: tuple[LimitScope, ...]
    tokens: int
    limiter: Limiter
    charges: tuple[BudgetCharge, ...] = ()  # what it took from each budget
    settled: bool = False

    def refunds(self, used: Spend) -> list[tuple[BudgetCharge, int]]:
        """Per budget charged: reserved minus used (negative: more was used)."""
        return [(c, c.amount - used.of(c.budget.unit)) for c in self.charges]


@dataclass(frozen=True, slots=True)
class ScopeLevels:
    """One scope's shared counters as Redis last reported them (None: unlimited, unknown)."""

    requests: float | None = None  # what the requests bucket holds (negative: in debt)
    tokens: float | None = None


@dataclass(frozen=True, slots=True)
class LimitDecision:
    admitted: bool
    snapshot: LimitSnapshot
    reservation: Reservation | None = None
    retry_after_s: float = 0.0
    # Which limit said no: requests_per_minute, tokens_per_minute, max_concurrent, budget
    # (`exhausted` says which), budget_unavailable (Redis is away: budgets are not spent).
    exceeded: str | None = None
    observed: tuple[ScopeLevels, ...] = ()  # per scope, from Redis (what a fallback seeds from)
    budgets: tuple[BudgetLevel, ...] = ()  # every budget charged, as this decision left it

    @property
    def exhausted(self) -> BudgetLevel | None:
        """The budget that refused the request: of those that did, the one resetting last."""
        out = [level for level in self.budgets if level.exhausted] if not self.admitted else []
        return max(out, key=lambda level: level.charge.resets_at, default=None)


class RequestTooLarge(Exception):
    """prompt + max_tokens exceeds a tokens-per-minute window or a whole budget: no retry can
    ever succeed."""

    def __init__(self, tokens: int, limit: int, what: str | None = None) -> None:
        what = what or f"tokens-per-minute limit of {limit}"
        super().__init__(
            f"This request needs {tokens} tokens (prompt + max_tokens), more than the "
            f"{what}; lower max_tokens or shorten the prompt."
        )
        self.tokens = tokens
        self.limit = limit


class Limiter(Protocol):
    """`reserve` takes the request's tokens (prompt + completion budget) and, for cost
    budgets, their cost in micro-USD; `settle` what was used (cost: of what was used)."""

    async def reserve(
        self, scopes: Sequence[LimitScope], tokens: int, micro_usd: int = 0
    ) -> LimitDecision: ...

    async def settle(
        self, reservation: Reservation, used_tokens: int, used_micro_usd: int = 0
    ) -> None: ...

    async def close(self) -> None: ...


LIMIT_NAMES = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "budget")


def budget_charges(
    scopes: Sequence[LimitScope], spend: Spend, wall: float
) -> tuple[BudgetCharge, ...]:
    """What a request takes from every budget of `scopes`; raises RequestTooLarge when one
    charge is more than its whole budget (or the request more than a tokens-per-minute window)."""
    for scope in scopes:
        tpm = scope.policy.tokens_per_minute
        if tpm is not None and spend.tokens > tpm:
            raise RequestTooLarge(spend.tokens, tpm)
    charges = charges_for(((s.key, s.policy.budgets) for s in scopes), spend, wall)
    for charge in charges:
        if charge.amount > charge.budget.limit:
            raise RequestTooLarge(spend.tokens, charge.budget.limit, charge.budget.describe())
    return charges


@dataclass(slots=True)
class _Bucket:
    level: float
    stamp: float


@dataclass(slots=True)
class _ScopeState:
    requests: _Bucket | None = None
    tokens: _Bucket | None = None
    live: dict[str, float] = field(default_factory=dict)  # reservation id -> lease expiry
    spent: dict[str, int] = field(default_factory=dict)  # `BudgetCharge.name` -> used


def _refill(bucket: _Bucket, capacity: int, now: float) -> None:
    rate = capacity / 60.0
    bucket.level = min(float(capacity), bucket.level + (now - bucket.stamp) * rate)
    bucket.stamp = now


def _window_refusal(
    scopes: Sequence[LimitScope], states: Sequence[_ScopeState], tokens: int
) -> tuple[str | None, float]:
    """Which request/token/concurrency window refuses `tokens` now, and for how long."""
    exceeded: str | None = None
    retry_after = 0.0
    for scope, state in zip(scopes, states, strict=True):
        p = scope.policy
        waits: list[tuple[str, float]] = []
        rpm, tpm = p.requests_per_minute, p.tokens_per_minute
        if state.requests is not None and rpm is not None and state.requests.level < 1.0:
            waits.append(("requests_per_minute", (1.0 - state.requests.level) * 60.0 / rpm))
        if state.tokens is not None and tpm is not None and state.tokens.level < tokens:
            waits.append(("tokens_per_minute", (tokens - state.tokens.level) * 60.0 / tpm))
        if p.max_concurrent is not None and len(state.live) >= p.max_concurrent:
            waits.append(("max_concurrent", 1.0))
        for name, wait in waits:
            if wait > retry_after or exceeded is None:
                exceeded, retry_after = name, max(retry_after, wait)
    return exceeded, retry_after


class LocalLimiter:
    """Limits kept in this process; atomic because the event loop runs one coroutine at a time."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    ) -> None:
        self._clock = clock
        self._wall = wall_clock
        self._lease_ttl_s = lease_ttl_s
        self._scopes: dict[str, _ScopeState] = {}

    def _state(self, scope: LimitScope, now: float) -> _ScopeState:
        state = self._scopes.get(scope.key)
        if state is None:
            state = self._scopes[scope.key] = _ScopeState()
        policy = scope.policy
        if policy.requests_per_minute is not None:
            if state.requests is None:
                state.requests = _Bucket(float(policy.requests_per_minute), now)
            _refill(state.requests, policy.requests_per_minute, now)
        if policy.tokens_per_minute is not None:
            if state.tokens is None:
                state.tokens = _Bucket(float(policy.tokens_per_minute), now)
            _refill(state.tokens, policy.tokens_per_minute, now)
        if state.live:
            expired = [rid for rid, until in state.live.items() if until <= now]
            for rid in expired:
                del state.live[rid]
        return state

    @staticmethod
    def _spent(state: _ScopeState, charge: BudgetCharge) -> int:
        """Used of `charge`'s budget this period; earlier periods of it are dropped."""
        prefix = charge.name.rsplit(":", 1)[0] + ":"
        for name in [n for n in state.spent if n.startswith(prefix) and n != charge.name]:
            del state.spent[name]
        return state.spent.get(charge.name, 0)

    def reset(self) -> None:
        """Forget every window: a fallback starts each outage from what it is seeded with."""
        self._scopes.clear()

    def seeded(self, key: str) -> bool:
        return key in self._scopes

    def seed(
        self, scope: LimitScope, levels: ScopeLevels | None, since: float, live: Iterable[str]
    ) -> None:
        """Start `scope`'s windows from known levels (seen at `since` on this clock, refilled
        from then on) instead of full ones; `live` are slots already taken elsewhere."""
        now, policy, state = self._clock(), scope.policy, _ScopeState()
        if levels is not None:
            if policy.requests_per_minute is not None and levels.requests is not None:
                state.requests = _Bucket(levels.requests, since)
            if policy.tokens_per_minute is not None and levels.tokens is not None:
                state.tokens = _Bucket(levels.tokens, since)
        for rid in live:
            state.live[rid] = now + self._lease_ttl_s
        self._scopes[scope.key] = state

    def forget(self, rid: str) -> None:
        """A slot seeded from elsewhere was given back."""
        for state in self._scopes.values():
            state.live.pop(rid, None)

    async def reserve(
        self, scopes: Sequence[LimitScope], tokens: int, micro_usd: int = 0
    ) -> LimitDecision:
        return self.reserve_now(scopes, tokens, micro_usd)

    def reserve_now(
        self, scopes: Sequence[LimitScope], tokens: int, micro_usd: int = 0
    ) -> LimitDecision:
        now, wall = self._clock(), self._wall()
        charges = budget_charges(scopes, Spend(tokens, micro_usd), wall)
        states = [self._state(scope, now) for scope in scopes]
        by_key = {scope.key: state for scope, state in zip(scopes, states, strict=True)}
        budgets = tuple(BudgetLevel(c, self._spent(by_key[c.scope_key], c)) for c in charges)
        exceeded, retry_after = _window_refusal(scopes, states, tokens)
        if any(level.exhausted for level in budgets):
            exceeded = "budget"
            retry_after = max(level.charge.resets_at for level in budgets if level.exhausted) - wall
        if exceeded is not None:
            snapshot = self._snapshot(scopes, states)
            return LimitDecision(False, snapshot, None, retry_after, exceeded, budgets=budgets)
        rid = uuid.uuid4().hex
        for scope, state in zip(scopes, states, strict=True):
            if state.requests is not None:
                state.requests.level -= 1.0
            if state.tokens is not None:
                state.tokens.level -= tokens
            if scope.policy.max_concurrent is not None:
                state.live[rid] = now + self._lease_ttl_s
        for level in budgets:
            spent = by_key[level.charge.scope_key].spent
            spent[level.charge.name] = level.used + level.charge.amount
        budgets = tuple(BudgetLevel(lv.charge, lv.used + lv.charge.amount, True) for lv in budgets)
        reservation = Reservation(rid, tuple(scopes), tokens, self, charges)
        return LimitDecision(True, self._snapshot(scopes, states), reservation, budgets=budgets)

    async def settle(
        self, reservation: Reservation, used_tokens: int, used_micro_usd: int = 0
    ) -> None:
        self.settle_now(reservation, used_tokens, used_micro_usd)

    def settle_now(
        self, reservation: Reservation, used_tokens: int, used_micro_usd: int = 0
    ) -> None:
        if reservation.settled:
            return
        reservation.settled = True
        now = self._clock()
        refund = reservation.tokens - used_tokens
        for scope in reservation.scopes:
            state = self._scopes.get(scope.key)
            if state is None:
                continue
            state.live.pop(reservation.id, None)
            if state.tokens is not None and scope.policy.tokens_per_minute is not None:
                _refill(state.tokens, scope.policy.tokens_per_minute, now)
                state.tokens.level = min(
                    float(scope.policy.tokens_per_minute), state.tokens.level + refund
                )
        for charge, back in reservation.refunds(Spend(used_tokens, used_micro_usd)):
            state = self._scopes.get(charge.scope_key)
            if state is not None and charge.name in state.spent:  # not a period that ended
                state.spent[charge.name] = max(0, state.spent[charge.name] - back)

    def _snapshot(
        self, scopes: Sequence[LimitScope], states: Sequence[_ScopeState]
    ) -> LimitSnapshot:
        if not scopes:
            return LimitSnapshot()
        p, state = scopes[0].policy, states[0]
        snap = LimitSnapshot()
        if state.requests is not None and p.requests_per_minute is not None:
            rpm = p.requests_per_minute
            level = max(0.0, state.requests.level)
            snap = LimitSnapshot(rpm, int(level), (rpm - level) * 60.0 / rpm, None, None, 0.0)
        if state.tokens is not None and p.tokens_per_minute is not None:
            tpm = p.tokens_per_minute
            level = state.tokens.level
            snap = LimitSnapshot(
                snap.limit_requests,
                snap.remaining_requests,
                snap.reset_requests_s,
                tpm,
                max(0, int(level)),
                (tpm - level) * 60.0 / tpm,
            )
        return snap

    async def close(self) -> None:
        return None
