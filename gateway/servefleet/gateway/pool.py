"""One deployment at run time: its queue, its replicas, and what has been measured about them.

This is where admission, queueing and routing meet. A request either takes a free slot at
once, or waits in the fair queue until `pump` hands it a replica (on every release, every
replica that becomes ready, and every ejection back-off that ends).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from servefleet.api.gateway_config import GatewayDeployment, RoutingConfig, TenantAccess
from servefleet.gateway.admission import Decision, PoolView, SpillRule, decide
from servefleet.gateway.queueing import FairQueue, QueuedRequest, TrafficClass
from servefleet.gateway.routing import Replica, ReplicaSet, ReplicaState
from servefleet.gateway.spill_budget import LocalSpillBudget, SpillBudget

if TYPE_CHECKING:  # the tokenizer is optional and loaded lazily
    from servefleet.gateway.token_counter import PromptTokenCounter


class Shed(Exception):
    """A queued request was pushed out or timed out; answer 503 with this Retry-After."""

    def __init__(self, retry_after_s: float, reason: str) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s
        self.reason = reason


@dataclass(slots=True, eq=False)
class Lease:
    """A slot on a replica, held from dispatch until the response ends."""

    replica: Replica
    tokens: int
    dispatched_at: float
    released: bool = False


@dataclass(slots=True)
class Ewma:
    value: float
    alpha: float = 0.2
    samples: int = 0

    def update(self, sample: float) -> None:
        # The first real measurement replaces the configured prior outright.
        self.value = (
            sample if self.samples == 0 else self.value + self.alpha * (sample - self.value)
        )
        self.samples += 1


class LatencyWindow:
    """Recent latencies (queue wait, TTFT) for a percentile the autoscaler can act on.

    A time window, not a histogram since start: the autoscaler needs what users see now.
    """

    def __init__(self, window_s: float = 60.0, max_samples: int = 4096) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, now: float, seconds: float) -> None:
        self._samples.append((now, seconds))

    def percentile(self, now: float, q: float) -> float | None:
        """The q-quantile (nearest rank) of the samples in the window; None without any."""
        samples = self._samples
        while samples and samples[0][0] < now - self.window_s:
            samples.popleft()
        if not samples:
            return None
        ordered = sorted(v for _, v in samples)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class DeploymentPool:
    def __init__(
        self,
        config: GatewayDeployment,
        routing: RoutingConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[DeploymentPool], None] | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        self.model = config.model
        self.routing = routing
        self._clock = clock
        self.queue = FairQueue(config.admission.max_queue_depth)
        self.replicas = ReplicaSet(
            cap=config.pool.per_replica_concurrency,
            eject_base_s=routing.eject_seconds,
            eject_max_s=routing.eject_max_seconds,
        )
        self.tenants: dict[str, TenantAccess] = {t.name: t for t in config.tenants}
        self.in_flight = 0
        self.service_time = Ewma(config.service_seconds)
        self.cold_start = Ewma(config.cold_start_seconds)
        self._completions: deque[float] = deque()
        self._seen_starting: set[str] = set()
        self.token_counter: PromptTokenCounter | None = None  # set once loaded (optional)
        self.queue_waits = LatencyWindow()
        self.ttfts = LatencyWindow()
        spill = config.spillover
        # Replaced by a Redis-shared budget when the gateway has Redis (see spill_budget).
        self.spill_budget: SpillBudget | None = (
            LocalSpillBudget(spill.max_requests_per_minute, clock) if spill is not None else None
        )
        self._spill_tenants = frozenset(spill.tenants) if spill is not None else frozenset()
        self._on_change = on_change or (lambda _pool: None)
        self.set_replicas(config.endpoints)

    # -- replicas -------------------------------------------------------------------------
    def set_replicas(self, endpoints: Iterable[str], ready: Iterable[str] | None = None) -> None:
        now = self._clock()
        before = {e: r.state for e, r in self.replicas.replicas.items()}
        self.replicas.set_endpoints(endpoints, now, ready=ready)
        for endpoint, replica in self.replicas.replicas.items():
            self._note_state(replica, before.get(endpoint), now)
        self.pump()

    def probe_result(self, replica: Replica, ready: bool) -> None:
        now = self._clock()
        before = replica.state
        if not ready and before is ReplicaState.STARTING:
            # Seen loading: its time to ready is a cold start worth measuring (a replica that
            # was already up when the gateway started is not).
            self._seen_starting.add(replica.endpoint)
        self.replicas.mark_probe(replica, ready, now)
        self._note_state(replica, before, now)
        if replica.state is not before:
            self.pump()

    def _note_state(self, replica: Replica, before: ReplicaState | None, now: float) -> None:
        if (
            replica.state is ReplicaState.READY
            and before is ReplicaState.STARTING
            and replica.endpoint in self._seen_starting
        ):
            # Measured cold start: first seen (not ready) until first ready.
            self._seen_starting.discard(replica.endpoint)
            self.cold_start.update(max(0.0, now - replica.first_seen))

    def eject(self, replica: Replica) -> None:
        now = self._clock()
        self.replicas.eject(replica, now)
        delay = max(0.0, replica.ejected_until - now)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        # The half-open trial after the back-off must not wait for some other event.
        loop.call_later(delay + 0.001, self.pump)

    def mark_draining(self, replica: Replica) -> None:
        self.replicas.mark_draining(replica)

    # -- measurements ---------------------------------------------------------------------
    def service_rate(self, now: float) -> tuple[float, float]:
        """(pool rate, one replica's rate) in requests/s, from the measured request duration."""
        per_replica = self.replicas.cap / max(self.service_time.value, 1e-3)
        return per_replica * self.replicas.ready_count(now), per_replica

    def completions_per_second(self, now: float, window_s: float = 60.0) -> float:
        while self._completions and self._completions[0] < now - window_s:
            self._completions.popleft()
        return len(self._completions) / window_s

    def seconds_until_ready(self, now: float) -> float | None:
        if self.replicas.ready_count(now) > 0:
            return None
        expected = self.cold_start.value
        starting = self.replicas.starting()
        if not starting:
            return expected  # nothing starting yet: the autoscaler has to start one
        return min(max(0.0, expected - (now - r.first_seen)) for r in starting)

    # -- admission ------------------------------------------------------------------------
    def spill_allowed(self, tenant: str) -> bool:
        spill = self.config.spillover
        if spill is None or self.spill_budget is None:
            return False
        if self._spill_tenants and tenant not in self._spill_tenants:
            return False
        return self.spill_budget.available()

    def admit(self, tenant: str, cls: TrafficClass, cost: float, weight: float) -> Decision:
        now = self._clock()
        queue = self.queue
        full = queue.full and queue.make_room(tenant, cls) is None
        rate, per_replica = self.service_rate(now)
        view = PoolView(
            ready_replicas=self.replicas.ready_count(now),
            free_slots=self.replicas.free_slots(now),
            queue_ahead=queue.ahead_of(tenant, cls, cost, weight) if len(queue) else 0,
            queue_full=full,
            service_rate=rate,
            per_replica_rate=per_replica,
            seconds_until_ready=self.seconds_until_ready(now),
        )
        spill = self.config.spillover
        rule = SpillRule(
            allowed=self.spill_allowed(tenant),
            on_queue_full=spill.when.queue_full if spill else False,
            on_no_ready_replica=spill.when.no_ready_replica if spill else False,
            wait_over_s=spill.when.predicted_wait_over_seconds if spill else None,
        )
        return decide(view, self.config.admission.max_queue_wait, rule)

    def dispatch_now(self, affinity_key: int | None, tokens: int) -> Lease | None:
        now = self._clock()
        replica = self.replicas.pick(affinity_key, now, slack=self.routing.affinity_slack)
        if replica is None:
            return None
        return self._lease(replica, tokens, now)

    def _lease(self, replica: Replica, tokens: int, now: float) -> Lease:
        self.replicas.acquire(replica, tokens)
        self.in_flight += 1
        return Lease(replica, tokens, now)

    async def wait_for_slot(
        self,
        tenant: str,
        cls: TrafficClass,
        cost: float,
        weight: float,
        affinity_key: int | None,
        tokens: int,
    ) -> tuple[Lease, float]:
        """Queue the request and wait for a replica; returns the lease and the queue wait.

        Raises Shed when it is pushed out or waits past maxQueueWait.
        """
        loop = asyncio.get_running_loop()
        now = self._clock()
        queue = self.queue
        if queue.full:
            victim = queue.make_room(tenant, cls)
            if victim is None:
                raise Shed(self._retry_after(now), "queue full")
            queue.cancel(victim)
            if victim.future is not None and not victim.future.done():
                victim.future.set_exception(
                    Shed(self._retry_after(now), "pushed out by a higher-priority request")
                )
        future: asyncio.Future[Lease] = loop.create_future()
        entry = queue.push(
            tenant, cls, cost, now, weight=weight, future=future, payload=(affinity_key, tokens)
        )
        self._on_change(self)
        self.pump()
        try:
            lease = await asyncio.wait_for(
                asyncio.shield(future), timeout=self.config.admission.max_queue_wait
            )
        except TimeoutError:
            if future.done() and not future.cancelled() and future.exception() is None:
                lease = future.result()  # dispatched at the very moment the wait ran out
            else:
                queue.cancel(entry)
                future.cancel()
                self._on_change(self)
                raise Shed(self._retry_after(self._clock()), "waited past maxQueueWait") from None
        except asyncio.CancelledError:
            # The client went away while queued: give the slot back if one was handed over.
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result(), ok=True)
            else:
                queue.cancel(entry)
                future.cancel()
            raise
        return lease, self._clock() - entry.enqueued_at

    def _retry_after(self, now: float) -> float:
        rate, per_replica = self.service_rate(now)
        ahead = len(self.queue)
        if rate > 0:
            return (ahead + 1) / rate
        return (self.seconds_until_ready(now) or 0.0) + ahead / max(per_replica, 1e-6)

    def pump(self) -> None:
        """Hand free slots to queued requests, in queue order."""
        queue = self.queue
        if not len(queue):
            return
        now = self._clock()
        changed = False
        while len(queue) and self.replicas.free_slots(now) > 0:
            entry: QueuedRequest | None = queue.pop()
            if entry is None:
                break
            changed = True
            future = entry.future
            if future is None or future.done():
                continue
            affinity_key, tokens = entry.payload
            replica = self.replicas.pick(affinity_key, now, slack=self.routing.affinity_slack)
            if replica is None:  # cannot happen while free_slots > 0; keep the request safe
                future.set_exception(Shed(self._retry_after(now), "no replica"))
                continue
            future.set_result(self._lease(replica, tokens, now))
        if changed:
            self._on_change(self)

    def reroute(self, lease: Lease) -> Lease | None:
        """Move a request that got no byte yet to another replica (the one retry)."""
        now = self._clock()
        other = self.replicas.pick(None, now, slack=0, exclude=lease.replica)
        if other is None:
            return None
        self.release(lease, ok=False)
        return self._lease(other, lease.tokens, now)

    def release(self, lease: Lease, *, ok: bool) -> None:
        if lease.released:
            return
        lease.released = True
        now = self._clock()
        self.in_flight -= 1
        if lease.replica.endpoint in self.replicas.replicas:
            self.replicas.release(lease.replica, lease.tokens)
        if ok:
            self.service_time.update(now - lease.dispatched_at)
            self._completions.append(now)
            self.replicas.record_success(lease.replica)
        self.pump()

    def record_queue_wait(self, seconds: float) -> None:
        self.queue_waits.add(self._clock(), seconds)

    def record_ttft(self, seconds: float) -> None:
        self.ttfts.add(self._clock(), seconds)

    # -- reporting ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        now = self._clock()
        rate, _ = self.service_rate(now)
        return {
            "name": self.name,
            "model": self.model,
            "queue_depth": len(self.queue),
            "queue_depth_interactive": self.queue.depth(TrafficClass.INTERACTIVE),
            "queue_depth_batch": self.queue.depth(TrafficClass.BATCH),
            "in_flight": self.in_flight,
            "service_rate": rate,
            "completions_per_second": self.completions_per_second(now),
            "mean_service_seconds": self.service_time.value,
            "cold_start_seconds": self.cold_start.value,
            # Over the last minute; None when nothing was measured in it.
            "queue_wait_p90_seconds": self.queue_waits.percentile(now, 0.9),
            "ttft_p90_seconds": self.ttfts.percentile(now, 0.9),
            "prompt_token_count": "estimate" if self.token_counter is None else "tokenizer",
            "ready_replicas": self.replicas.ready_count(now),
            "replicas": [
                {
                    "endpoint": r.endpoint,
                    "state": r.state.value,
                    "outstanding": r.outstanding,
                    "cap": r.cap,
                    "served": r.served,
                }
                for r in self.replicas.replicas.values()
            ],
        }


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
