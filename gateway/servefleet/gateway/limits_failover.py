"""Limits that survive a Redis outage without handing anyone a second window or budget.

`FailoverLimiter` uses the shared `RedisLimiter` while Redis answers; while it does not, each
gateway replica enforces its share (1/N) of every limit locally and retries Redis after a
back-off (and from the lease loop, so recovery does not wait for traffic). Two things keep
the outage from doubling a tenant's limits:

- **Seeded windows.** A replica remembers the shared levels of every scope it served (each
  reservation returns them; the lease loop refreshes them every `REDIS_LEASE_TTL_S / 3`). An
  outage starts its local windows from its share of those levels, refilled since at its share
  of the rate, and counts its own slots still held in Redis; a fresh window is used only for a
  scope it never saw.
- **Write-back.** Requests and tokens used locally (less the refunds of settled requests, and
  the refunds Redis missed) are charged to the shared windows and the day's counter when Redis
  is back, before the next reservation there: windows may go into debt and refill from it.

- **Budgets are not spent blind.** A scope with a budget (tokens or cost per day or month) is
  refused while Redis is unreachable (`budget_unavailable`, a 503 with Retry-After), because a
  replica cannot know what the others spent since it last looked: a share of a stale level
  would let N replicas pass the budget together. Refunds of reservations made in Redis whose
  settlement failed are given back when it returns.

The bounds: with one gateway replica a tenant gets no more than its windows across an
outage; with several, a window can be exceeded during the outage only by what the tenant was
admitted through other replicas since a replica last saw the scope (at most one refresh
period, 10 s), and that excess, like everything used locally, is charged when Redis returns.
A budget is only ever charged in Redis, atomically, whole reservation first: across gateway
restarts (its state is only in Redis; a reservation a dead gateway never settled stays
charged in full), outages and failovers that keep Redis' data, a tenant passes a budget by at
most one request's reservation (a request whose real usage exceeds what was reserved — the
engine counted more prompt tokens than the gateway — is settled at what it used).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from servefleet.gateway.budgets import BudgetCharge
from servefleet.gateway.limits import (
    LimitDecision,
    LimitPolicy,
    LimitScope,
    LimitSnapshot,
    LocalLimiter,
    Reservation,
    ScopeLevels,
    Spend,
)
from servefleet.gateway.limits_redis import Debt, RedisLimiter, RedisUnavailable

log = logging.getLogger("servefleet.gateway.limits")

MAX_KNOWN_SCOPES = 10_000  # scopes whose shared levels are refreshed (tenants x models)


@dataclass(frozen=True, slots=True)
class _Seen:
    levels: ScopeLevels
    at: float  # this limiter's clock


class FailoverLimiter:
    """Redis first; while Redis is unreachable, per-replica local limits. Recovers by itself.

    While degraded every replica enforces `share` of each limit locally (share = 1 / number of
    gateway replicas), seeded from the shared levels it last saw, and writes back what it used
    once Redis answers again. Redis is retried after a back-off that doubles up to
    `max_backoff_s`.
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
        self._known: dict[str, LimitScope] = {}  # by key: the scopes whose levels are kept
        self._seen: dict[str, _Seen] = {}
        self._debts: dict[str, Debt] = {}  # scope key -> not yet charged
        self._refunds: dict[str, tuple[BudgetCharge, int]] = {}  # budget key -> owed to it
        self._full_scopes: dict[str, tuple[LimitScope, ...]] = {}  # local reservation id ->

    # -- Redis state -----------------------------------------------------------------------
    def _failed(self, op: str, exc: Exception) -> None:
        self._on_error(op)
        if not self.degraded:
            log.warning(
                "redis unreachable (%s: %s); enforcing per-replica limits (share %.2f, from the "
                "last shared levels seen) until it is back",
                op,
                exc,
                self._share,
            )
            self.fallback.reset()  # this outage's windows are seeded afresh
        else:
            self._backoff = min(self._max_backoff, self._backoff * 2)
        self.degraded = True
        self._retry_at = self._clock() + self._backoff

    def _recovered(self) -> None:
        if self.degraded:
            log.warning("redis is back; limits are shared across replicas again")
            self.degraded = False
            self._backoff = self._min_backoff

    async def _write_back(self) -> None:
        """Charge what was used locally to Redis and give budgets their missed refunds;
        raises RedisUnavailable (what was not written is kept for later)."""
        if self._debts:
            debts, self._debts = self._debts, {}
            try:
                await self.primary.debit(list(debts.values()))
            except RedisUnavailable:
                for debt in debts.values():  # new debts may have come meanwhile: add
                    self._owe(debt.scope, debt.requests, debt.tokens)
                raise
        if self._refunds:
            refunds, self._refunds = self._refunds, {}
            try:
                await self.primary.refund(list(refunds.values()))
            except RedisUnavailable:
                for charge, back in refunds.values():
                    self._give_back(charge, back)
                raise

    def _owe(self, scope: LimitScope, requests: int, tokens: int) -> None:
        debt = self._debts.get(scope.key)
        if debt is None:
            debt = self._debts[scope.key] = Debt(scope)
        debt.requests += requests
        debt.tokens += tokens

    def _give_back(self, charge: BudgetCharge, back: int) -> None:
        key = self.primary.budget_key(charge)
        _, owed = self._refunds.get(key, (charge, 0))
        self._refunds[key] = (charge, owed + back)

    def _remember(self, scopes: Sequence[LimitScope], observed: Sequence[ScopeLevels]) -> None:
        now = self._clock()
        for scope, levels in zip(scopes, observed, strict=False):
            self._seen[scope.key] = _Seen(levels, now)
        for scope in scopes:
            if scope.key not in self._known and len(self._known) >= MAX_KNOWN_SCOPES:
                self._known.pop(next(iter(self._known)))
            self._known[scope.key] = scope

    # -- the Limiter interface -------------------------------------------------------------
    async def reserve(
        self, scopes: Sequence[LimitScope], tokens: int, micro_usd: int = 0
    ) -> LimitDecision:
        if not self.degraded or self._clock() >= self._retry_at:
            try:
                await self._write_back()
                decision = await self.primary.reserve(scopes, tokens, micro_usd)
            except RedisUnavailable as exc:
                self._failed("reserve", exc)
            else:
                self._recovered()
                self._remember(scopes, decision.observed)
                return decision
        return self._reserve_locally(scopes, tokens)

    def _reserve_locally(self, scopes: Sequence[LimitScope], tokens: int) -> LimitDecision:
        if any(scope.policy.budgets for scope in scopes):  # see the module's docstring
            wait = max(self._retry_at - self._clock(), self._min_backoff)
            return LimitDecision(False, LimitSnapshot(), None, wait, "budget_unavailable")
        local = self._local_scopes(scopes)
        decision = self.fallback.reserve_now(local, tokens)
        reservation = decision.reservation
        if reservation is not None:
            self._full_scopes[reservation.id] = tuple(scopes)
            for scope in scopes:
                self._owe(scope, 1, tokens)
        return decision

    def _local_scopes(self, scopes: Sequence[LimitScope]) -> list[LimitScope]:
        out = []
        for scope in scopes:
            scaled = self._scaled.get(scope.policy)
            if scaled is None:
                scaled = self._scaled[scope.policy] = scope.policy.scaled(self._share)
            local = LimitScope(scope.key, scaled)
            if not self.fallback.seeded(scope.key):
                self._seed(scope, local)
            out.append(local)
        return out

    def _seed(self, scope: LimitScope, local: LimitScope) -> None:
        """`local`'s windows from this replica's share of the shared levels it last saw."""
        seen = self._seen.get(scope.key)
        levels = None if seen is None else self._share_of(seen.levels)
        since = self._clock() if seen is None else seen.at
        live = self.primary.leases_on(scope) if local.policy.max_concurrent else []
        self.fallback.seed(local, levels, since, live)

    def _share_of(self, levels: ScopeLevels) -> ScopeLevels:
        share = self._share
        return ScopeLevels(
            None if levels.requests is None else levels.requests * share,
            None if levels.tokens is None else levels.tokens * share,
        )

    async def settle(
        self, reservation: Reservation, used_tokens: int, used_micro_usd: int = 0
    ) -> None:
        refund = reservation.tokens - used_tokens
        if reservation.limiter is self.fallback:
            # Settled where it was made (the scaled scopes); the refund lowers the debt.
            self.fallback.settle_now(reservation, used_tokens, used_micro_usd)
            for scope in self._full_scopes.pop(reservation.id, ()):
                self._owe(scope, 0, -refund)
            return
        self.fallback.forget(reservation.id)  # a slot the outage's windows counted
        try:
            await self.primary.settle(reservation, used_tokens, used_micro_usd)
        except RedisUnavailable as exc:
            # The concurrency lease expires on its own; the refunds are written back later.
            for scope in reservation.scopes:
                self._owe(scope, 0, -refund)
            for charge, back in reservation.refunds(Spend(used_tokens, used_micro_usd)):
                self._give_back(charge, back)
            self._failed("settle", exc)

    async def keep_leases(self) -> None:
        """Renew this gateway's concurrency leases in Redis for as long as it runs (a task the
        gateway starts and cancels), refreshing the shared levels it keeps at the same time;
        an unreachable Redis is one more failure, never the end. While degraded it also pings
        Redis each time the back-off ends, so the limits are shared again (and what was used
        meanwhile written back) as soon as Redis is back, whether or not requests arrive."""
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
                    if not self.degraded:
                        await self._refresh()
                except RedisUnavailable as exc:
                    self._failed("renew", exc)

    async def _refresh(self) -> None:
        scopes = list(self._known.values())
        if scopes:
            self._remember(scopes, await self.primary.observe(scopes))
        await self._write_back()  # refunds of local reservations settled after recovery

    async def _probe(self) -> None:
        try:
            await self.primary.ping()
            await self._write_back()
        except RedisUnavailable as exc:
            self._failed("ping", exc)
        else:
            self._recovered()

    async def close(self) -> None:
        await self.primary.close()
