"""Per-tenant limits: reserve at admission, settle when the response ends.

Tokens are *reserved* (prompt + max_tokens) before a request is dispatched and the unused part
is given back at the end, so bursts and long streams cannot overshoot a tenant's window.
Request and token windows are token buckets holding one minute of allowance that refill
continuously (OpenAI's own semantics); the daily budget is a counter per UTC day; concurrency is
a set of live reservation ids whose leases expire, so a crashed gateway cannot leak slots.

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

SECONDS_PER_DAY = 86400
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
    daily_tokens: int | None = None

    def scaled(self, share: float) -> LimitPolicy:
        """This policy divided among `1/share` gateway replicas (at least 1 of everything)."""

        def part(value: int | None) -> int | None:
            return None if value is None else max(1, math.floor(value * share))

        return LimitPolicy(
            part(self.requests_per_minute),
            part(self.tokens_per_minute),
            part(self.max_concurrent),
            part(self.daily_tokens),
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
    day: int
    limiter: Limiter
    settled: bool = False


@dataclass(frozen=True, slots=True)
class ScopeLevels:
    """One scope's shared counters as Redis last reported them (None: unlimited, unknown)."""

    requests: float | None = None  # what the requests bucket holds (negative: in debt)
    tokens: float | None = None
    day_used: int | None = None  # daily tokens used on `day`
    day: int = -1


@dataclass(frozen=True, slots=True)
class LimitDecision:
    admitted: bool
    snapshot: LimitSnapshot
    reservation: Reservation | None = None
    retry_after_s: float = 0.0
    # Which limit said no: requests_per_minute, tokens_per_minute, max_concurrent, daily_tokens.
    exceeded: str | None = None
    observed: tuple[ScopeLevels, ...] = ()  # per scope, from Redis (what a fallback seeds from)


class RequestTooLarge(Exception):
    """prompt + max_tokens exceeds a tokens-per-minute window: no retry can ever succeed."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(
            f"This request needs {tokens} tokens (prompt + max_tokens), more than the "
            f"tokens-per-minute limit of {limit}; lower max_tokens or shorten the prompt."
        )
        self.tokens = tokens
        self.limit = limit


class Limiter(Protocol):
    async def reserve(self, scopes: Sequence[LimitScope], tokens: int) -> LimitDecision: ...

    async def settle(self, reservation: Reservation, used_tokens: int) -> None: ...

    async def close(self) -> None: ...


LIMIT_NAMES = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "daily_tokens")


def check_request_size(scopes: Sequence[LimitScope], tokens: int) -> None:
    for scope in scopes:
        tpm = scope.policy.tokens_per_minute
        if tpm is not None and tokens > tpm:
            raise RequestTooLarge(tokens, tpm)
        daily = scope.policy.daily_tokens
        if daily is not None and tokens > daily:
            raise RequestTooLarge(tokens, daily)


def seconds_until_next_day(now_wall: float) -> float:
    return SECONDS_PER_DAY - (now_wall % SECONDS_PER_DAY)


@dataclass(slots=True)
class _Bucket:
    level: float
    stamp: float


@dataclass(slots=True)
class _ScopeState:
    requests: _Bucket | None = None
    tokens: _Bucket | None = None
    live: dict[str, float] = field(default_factory=dict)  # reservation id -> lease expiry
    day: int = -1
    day_used: int = 0


def _refill(bucket: _Bucket, capacity: int, now: float) -> None:
    rate = capacity / 60.0
    bucket.level = min(float(capacity), bucket.level + (now - bucket.stamp) * rate)
    bucket.stamp = now


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

    def _state(self, scope: LimitScope, now: float, today: int) -> _ScopeState:
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
        if state.day != today:
            state.day, state.day_used = today, 0
        return state

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
            today = int(self._wall() // SECONDS_PER_DAY)
            known = policy.daily_tokens is not None and levels.day_used is not None
            if known and levels.day == today and levels.day_used is not None:
                state.day, state.day_used = today, levels.day_used
        for rid in live:
            state.live[rid] = now + self._lease_ttl_s
        self._scopes[scope.key] = state

    def forget(self, rid: str) -> None:
        """A slot seeded from elsewhere was given back."""
        for state in self._scopes.values():
            state.live.pop(rid, None)

    async def reserve(self, scopes: Sequence[LimitScope], tokens: int) -> LimitDecision:
        return self.reserve_now(scopes, tokens)

    def reserve_now(self, scopes: Sequence[LimitScope], tokens: int) -> LimitDecision:
        check_request_size(scopes, tokens)
        now, wall = self._clock(), self._wall()
        today = int(wall // SECONDS_PER_DAY)
        states = [self._state(scope, now, today) for scope in scopes]
        exceeded: str | None = None
        retry_after = 0.0
        for scope, state in zip(scopes, states, strict=True):
            p = scope.policy
            waits: list[tuple[str, float]] = []
            rpm, tpm = p.requests_per_minute, p.tokens_per_minute
            if state.requests is not None and rpm is not None and state.requests.level < 1.0:
                wait = (1.0 - state.requests.level) * 60.0 / rpm
                waits.append(("requests_per_minute", wait))
            if state.tokens is not None and tpm is not None and state.tokens.level < tokens:
                wait = (tokens - state.tokens.level) * 60.0 / tpm
                waits.append(("tokens_per_minute", wait))
            if p.max_concurrent is not None and len(state.live) >= p.max_concurrent:
                waits.append(("max_concurrent", 1.0))
            if p.daily_tokens is not None and state.day_used + tokens > p.daily_tokens:
                waits.append(("daily_tokens", seconds_until_next_day(wall)))
            for name, wait in waits:
                if wait > retry_after or exceeded is None:
                    exceeded, retry_after = name, max(retry_after, wait)
        if exceeded is not None:
            return LimitDecision(False, self._snapshot(scopes, states), None, retry_after, exceeded)
        rid = uuid.uuid4().hex
        for scope, state in zip(scopes, states, strict=True):
            if state.requests is not None:
                state.requests.level -= 1.0
            if state.tokens is not None:
                state.tokens.level -= tokens
            if scope.policy.max_concurrent is not None:
                state.live[rid] = now + self._lease_ttl_s
            state.day_used += tokens
        reservation = Reservation(rid, tuple(scopes), tokens, today, self)
        return LimitDecision(True, self._snapshot(scopes, states), reservation)

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        self.settle_now(reservation, used_tokens)

    def settle_now(self, reservation: Reservation, used_tokens: int) -> None:
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
            if state.day == reservation.day:
                state.day_used = max(0, state.day_used - refund)

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
