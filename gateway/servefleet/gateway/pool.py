"""One deployment at run time: its queue, its replicas, and what has been measured about them.

`acquire(request)` is the pool's one entry point (KubeAI's `AwaitBestAddress` plays the same
part): it decides once, through `admission`, whether a request is served, queued, spilled or
shed, and does the waiting itself, so a caller only acts on the answer — a `Lease` on a
replica, a `Spill` (the spill-over budget already taken) or a `Shed`. Queued requests wait in
the fair queue until `pump` hands them a replica: on every release, every replica that becomes
ready, and every ejection back-off that ends; broken streams waiting for another replica
(`pool_resume`, driven by callbacks from here) are served first.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from servefleet.api.batch_demand import BatchDue, lines_per_second_needed
from servefleet.api.ewma import Ewma
from servefleet.api.gateway_config import GatewayDeployment, RoutingConfig, TenantAccess
from servefleet.api.gateway_stats import DeploymentStats, ReplicaHealth
from servefleet.api.llmdeployment import batch_reserve
from servefleet.api.outcomes import Outcome
from servefleet.gateway.adapter_loads import AdapterLoads
from servefleet.gateway.admission import Admission, PoolView, SpillRule, decide
from servefleet.gateway.kv_cost import Decision
from servefleet.gateway.kv_index import KVIndex
from servefleet.gateway.measurements import LatencyWindow, RateWindow
from servefleet.gateway.pd_pool import PromptTokenGauge, prefill_deployment, prefill_stats
from servefleet.gateway.placement import Target, choose_target
from servefleet.gateway.pool_resume import ResumeWaiters
from servefleet.gateway.pool_types import Lease, Placement, PoolRequest, Shed, Spill
from servefleet.gateway.pool_waiting import ShedWhileQueued, wait_for_slot
from servefleet.gateway.queueing import FairQueue, TrafficClass
from servefleet.gateway.retry_promises import RetryPromises
from servefleet.gateway.routing import Replica, ReplicaSet
from servefleet.gateway.spill_budget import LocalSpillBudget, SpillBudget

if TYPE_CHECKING:  # the tokenizer is optional and loaded lazily
    from servefleet.gateway.token_counter import PromptTokenCounter

__all__ = ["DeploymentPool", "Lease", "Placement", "PoolRequest", "Shed", "Spill"]


class DeploymentPool:
    def __init__(
        self,
        config: GatewayDeployment,
        routing: RoutingConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
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
        self.batch_reserve = batch_reserve(config.pool.per_replica_concurrency, config.admission)
        self.in_flight = 0
        self.in_flight_batch = 0
        self.batch_due: list[BatchDue] = []  # open batches' lines for it (`batch_demand`)
        self._batch_wall_offset = 0.0  # wall clock minus this pool's clock, when it was set
        self.service_time = Ewma(config.service_seconds)
        self.cold_start = Ewma(config.cold_start_seconds)
        self._completions = RateWindow()
        self._spills, self._spilled_tokens = RateWindow(), RateWindow()  # autoscaler's rent-or-buy
        self._seen_starting: set[str] = set()
        self.token_counter: PromptTokenCounter | None = None  # set once loaded (optional)
        self.queue_waits = LatencyWindow()
        self.ttfts = LatencyWindow()
        self.promises = RetryPromises()
        self.resuming = ResumeWaiters()
        spill = config.spillover
        # Replaced by a Redis-shared budget when the gateway has Redis (see spill_budget).
        self.spill_budget: SpillBudget | None = (
            LocalSpillBudget(spill.max_requests_per_minute, clock) if spill is not None else None
        )
        self._spill_tenants = frozenset(spill.tenants) if spill is not None else frozenset()
        self.adapter_loads = AdapterLoads(clock)
        prefill = prefill_deployment(config)  # disaggregated P/D: the prefill pool (`pd`)
        self.prefill = DeploymentPool(prefill, routing, clock=clock) if prefill else None
        self.prefill_overflow = PromptTokenGauge()
        self.kv_index = KVIndex()  # fed by kv_subscriber (a PoolTasks task)
        self.kv_decisions: dict[Decision, int] = {}  # routing decisions, counted (metrics)
        self.set_replicas(config.endpoints)

    def now(self) -> float:
        return self._clock()

    def inherit(self, old: DeploymentPool) -> None:
        """A pool replacing `old` keeps what was learned: replicas, timings, tokenizer."""
        if old.replicas.replicas and self.config.service == old.config.service:
            ready = [e for e, r in old.replicas.replicas.items() if r.state is ReplicaHealth.READY]
            self.set_replicas(list(old.replicas.replicas), ready)
            for endpoint, replica in self.replicas.replicas.items():
                replica.adapters = set(old.replicas.replicas[endpoint].adapters)
        self.adapter_loads = old.adapter_loads
        self.service_time = old.service_time
        self.cold_start = old.cold_start
        self.promises = old.promises
        self.kv_index, self.kv_decisions = old.kv_index, old.kv_decisions
        self.batch_due, self._batch_wall_offset = old.batch_due, old._batch_wall_offset
        if self.config.tokenizer == old.config.tokenizer:
            self.token_counter = old.token_counter

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
        if not ready and before is ReplicaHealth.STARTING:
            # Seen loading: its time to ready is a cold start worth measuring (a replica that
            # was already up when the gateway started is not).
            self._seen_starting.add(replica.endpoint)
        self.replicas.mark_probe(replica, ready, now)
        self._note_state(replica, before, now)
        if replica.state is not before:
            self.pump()

    def _note_state(self, replica: Replica, before: ReplicaHealth | None, now: float) -> None:
        if (
            replica.state is ReplicaHealth.READY
            and before is ReplicaHealth.STARTING
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

    def seconds_until_ready(self, now: float) -> float | None:
        if self.replicas.ready_count(now) > 0:
            return None
        expected = self.cold_start.value
        starting = self.replicas.starting()
        if not starting:
            return expected  # nothing starting yet: the autoscaler has to start one
        return min(max(0.0, expected - (now - r.first_seen)) for r in starting)

    def set_batch_due(self, due: list[BatchDue], wall_now: float) -> None:
        """Open batches' lines and wall-clock deadlines for this deployment (`batch_demand`)."""
        self.batch_due = due
        self._batch_wall_offset = wall_now - self._clock()

    def record_ttft(self, seconds: float) -> None:
        self.ttfts.add(self._clock(), seconds)

    # -- the entry point ------------------------------------------------------------------
    async def acquire(self, request: PoolRequest) -> Placement:
        """Serve, queue, spill or shed: decided once here, waited for here. A request back at
        the time its Retry-After gave it is let into the queue even when it is full."""
        promised = bool(self.promises) and self.promises.redeem(request.retry_key, self._clock())
        admitted = self._admit(request, promised)
        if admitted.placed is Outcome.SHED:
            return self.refuse(request, admitted.predicted_wait_s, admitted.reason)
        if admitted.now:
            lease = self._dispatch_now(request)
            if lease is not None:
                self.granted(request, lease)
                return lease
        elif admitted.placed is Outcome.SPILLED:
            budget = self.spill_budget
            if budget is not None and await budget.take():
                now = self._clock()
                self._spills.add(now)
                self._spilled_tokens.add(now, request.tokens)
                return Spill(admitted.reason)
            if admitted.predicted_wait_s > self.config.admission.max_queue_wait:
                return self.refuse(
                    request, admitted.predicted_wait_s, "spill-over rate cap reached"
                )
        # Queued, a free slot taken by someone else meanwhile, or spill-over capped.
        return await wait_for_slot(self, request, self.config.admission.max_queue_wait, promised)

    def refuse(self, request: PoolRequest, wait_s: float, reason: str) -> Shed:
        """A Shed whose Retry-After is a promise: its own return time (see retry_promises)."""
        now = self._clock()
        rate, _ = self.service_rate(now)
        return Shed(self.promises.promise(request.retry_key, now, wait_s, rate), reason)

    def _spill_allowed(self, tenant: str) -> bool:
        if self.config.spillover is None or self.spill_budget is None:
            return False
        if self._spill_tenants and tenant not in self._spill_tenants:
            return False
        return self.spill_budget.available()

    def _admit(self, request: PoolRequest, promised: bool) -> Admission:
        """A promised retry finds room; a fresh request counts the promises falling due as
        queued ahead of it, so it does not take the room kept for them."""
        now = self._clock()
        queue = self.queue
        tenant, cls = request.tenant, request.traffic_class
        held = 0 if promised or not self.promises else self.promises.falling_due(now, 1.0)
        full = not promised and (
            (queue.full and queue.make_room(tenant, cls) is None)
            or (held > 0 and len(queue) + held >= queue.max_depth)
        )
        rate, per_replica = self.service_rate(now)
        ahead = queue.ahead_of(tenant, cls, request.tokens, request.weight) if len(queue) else 0
        view = PoolView(
            ready_replicas=self.replicas.ready_count(now),
            free_slots=self.replicas.free_slots(now, self.reserve_for(cls)) - held,
            queue_ahead=ahead + held,
            queue_full=full,
            service_rate=rate,
            per_replica_rate=per_replica,
            seconds_until_ready=self.seconds_until_ready(now),
        )
        spill = self.config.spillover
        # Batch work waits for the pool's spare capacity, never paid for elsewhere while the
        # pool has a replica (a route with none, e.g. hosted-only, spills as before).
        may_spill = cls is TrafficClass.INTERACTIVE or view.ready_replicas == 0
        rule = SpillRule(
            allowed=may_spill and self._spill_allowed(tenant),
            on_queue_full=spill.when.queue_full if spill else False,
            on_no_ready_replica=spill.when.no_ready_replica if spill else False,
            wait_over_s=spill.when.predicted_wait_over_seconds if spill else None,
        )
        return decide(view, self.config.admission.max_queue_wait, rule)

    def batch_slots(self) -> int:
        """Slots of its ready replicas batch requests may hold (busy or not)."""
        ready = self.replicas.ready_count(self._clock())
        return ready * (self.replicas.cap - self.batch_reserve)

    def reserve_for(self, traffic_class: TrafficClass) -> int:
        """Slots per replica a request of this class may not take."""
        return self.batch_reserve if traffic_class is TrafficClass.BATCH else 0

    def count_kv_decision(self, decision: Decision) -> None:
        """One dispatch's KV placement, for `kv_route_metrics`."""
        self.kv_decisions[decision] = self.kv_decisions.get(decision, 0) + 1

    def _dispatch_now(self, request: PoolRequest) -> Lease | None:
        """A lease on the replica `placement` chooses; None when none has room for it."""
        now = self._clock()
        reserve = self.reserve_for(request.traffic_class)
        target, decision = choose_target(
            self.replicas,
            self.kv_index,
            self.config,
            request,
            now,
            slack=self.routing.affinity_slack,
            reserve=reserve,
        )
        if decision is not None:
            self.count_kv_decision(decision)
        if target is None:
            return None
        return self._lease(target, request.tokens, now)

    def _lease(self, target: Target, tokens: int, now: float) -> Lease:
        self.replicas.acquire(target.replica, tokens)
        self.in_flight += 1
        return Lease(
            target.replica,
            tokens,
            now,
            kv_source=target.kv_source,
            kv_deadline_s=target.kv_deadline_s,
        )

    def granted(self, request: PoolRequest, lease: Lease) -> None:
        """Note a batch slot apart, and only interactive waits: a batch backlog may wait, and
        neither its queue nor its running requests buy replicas by themselves."""
        if request.traffic_class is TrafficClass.INTERACTIVE:
            self.queue_waits.add(self._clock(), lease.queue_wait_s)
        else:
            lease.batch = True
            self.in_flight_batch += 1

    def retry_after(self, now: float) -> float:
        rate, per_replica = self.service_rate(now)
        ahead = len(self.queue)
        if rate > 0:
            return (ahead + 1) / rate
        return (self.seconds_until_ready(now) or 0.0) + ahead / max(per_replica, 1e-6)

    def pump(self) -> None:
        """Hand free slots to broken streams waiting (`reroute_waiting`), then to the queue."""
        if self.resuming:
            self.resuming.serve(self.lease_elsewhere)
        queue = self.queue
        if not len(queue):
            return
        now = self._clock()
        while len(queue) and self.replicas.free_slots(now) > 0:
            batch_room = self.replicas.free_slots(now, self.batch_reserve) > 0
            entry = queue.pop(TrafficClass.BATCH if batch_room else TrafficClass.INTERACTIVE)
            if entry is None:
                break
            future = entry.future
            if future is None or future.done():
                continue
            lease = self._dispatch_now(entry.payload)
            if lease is None:  # cannot happen while free_slots > 0; keep the request safe
                future.set_exception(ShedWhileQueued(Shed(self.retry_after(now), "no replica")))
                continue
            future.set_result(lease)

    # -- after dispatch -------------------------------------------------------------------
    def reroute(self, lease: Lease) -> Lease | None:
        """Move a request that got no byte yet to another replica (the one retry)."""
        moved = self.lease_elsewhere(lease)
        if moved is not None:
            self.release(lease, ok=False)
        return moved

    async def reroute_waiting(self, broken: Lease, timeout_s: float) -> Lease | None:
        """`reroute` for a stream its replica broke: when other replicas are ready but all
        busy, wait (at most `timeout_s`) for one of their slots instead of giving up."""
        moved = self.reroute(broken)
        if moved is not None or not self.replicas.others_ready(broken.replica):
            return moved
        self.release(broken, ok=False)
        release = functools.partial(self.release, ok=True)
        return await self.resuming.wait(broken, timeout_s, pump=self.pump, release=release)

    def lease_elsewhere(self, lease: Lease) -> Lease | None:
        """A slot for `lease`'s request on another replica, if one is free now."""
        now = self._clock()
        traffic_class = TrafficClass.BATCH if lease.batch else TrafficClass.INTERACTIVE
        reserve = self.reserve_for(traffic_class)
        other = self.replicas.pick(None, now, slack=0, exclude=lease.replica, reserve=reserve)
        if other is None:
            return None
        moved = self._lease(Target(other), lease.tokens, now)
        moved.batch = lease.batch
        self.in_flight_batch += lease.batch
        return moved

    def release(self, lease: Lease, *, ok: bool) -> None:
        if lease.released:
            return
        lease.released = True
        now = self._clock()
        self.in_flight -= 1
        self.in_flight_batch -= lease.batch
        if lease.replica.endpoint in self.replicas.replicas:
            self.replicas.release(lease.replica, lease.tokens)
        if ok:
            self.service_time.update(now - lease.dispatched_at)
            self._completions.add(now)
            self.replicas.record_success(lease.replica)
        self.pump()

    # -- reporting ------------------------------------------------------------------------
    def stats(self) -> DeploymentStats:
        now = self._clock()
        rate, _ = self.service_rate(now)
        return DeploymentStats(
            name=self.name,
            model=self.model,
            queue_depth=len(self.queue),
            queue_depth_interactive=self.queue.depth(TrafficClass.INTERACTIVE),
            queue_depth_batch=self.queue.depth(TrafficClass.BATCH),
            in_flight=self.in_flight,
            in_flight_batch=self.in_flight_batch,
            service_rate=rate,
            completions_per_second=self._completions.per_second(now),
            spilled_per_second=self._spills.per_second(now),
            spilled_tokens_per_second=self._spilled_tokens.per_second(now),
            batch_lines_left=sum(d.lines for d in self.batch_due),
            batch_lines_per_second_needed=lines_per_second_needed(
                ((d.lines, d.expires_at) for d in self.batch_due),
                now + self._batch_wall_offset,
            ),
            batch_due=self.batch_due,
            mean_service_seconds=self.service_time.value,
            cold_start_seconds=self.cold_start.value,
            queue_wait_p90_seconds=self.queue_waits.percentile(now, 0.9),
            ttft_p90_seconds=self.ttfts.percentile(now, 0.9),
            prompt_token_count="estimate" if self.token_counter is None else "tokenizer",
            ready_replicas=self.replicas.ready_count(now),
            replicas=self.replicas.stats(),
            adapter_load_errors=self.adapter_loads.errors(),
            **prefill_stats(self.prefill.replicas if self.prefill else None, self.prefill_overflow),
        )
