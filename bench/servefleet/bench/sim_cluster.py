"""Discrete-event model of one deployment: a gateway in front of a replica pool.

Each replica holds at most `concurrency` requests; a request occupies a slot for its service
time. The gateway queues interactive requests ahead of batch ones and, when spill-over is on,
sends an interactive request to the hosted API when its predicted wait is over the threshold
(batch requests wait). New replicas serve after `cold_start_s`; a draining replica takes no
new work and goes away once empty. Replica-hours count every replica that exists (starting,
ready, draining), because that is what the GPUs cost.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from servefleet.autoscaler.signals import ReplicaState

from .sim_trace import Trace


class SpillSpec(BaseModel):
    """The gateway's spill-over to a hosted API (interactive requests only)."""

    model_config = ConfigDict(frozen=True)

    enabled: bool = False
    wait_threshold_s: float = Field(default=2.0, gt=0, description="predicted wait that spills")


class ClusterSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    concurrency: int = Field(default=8, ge=1, description="slots per replica")
    cold_start_s: float = Field(default=60.0, ge=0)
    initial_replicas: int = Field(default=1, ge=0)
    tick_s: float = Field(default=10.0, gt=0, description="autoscaler interval")
    latency_window_s: float = Field(default=30.0, gt=0, description="window of measured waits")
    spill: SpillSpec = Field(default_factory=SpillSpec)


@dataclass
class SimReplica:
    name: str
    state: ReplicaState
    created_s: float
    in_flight: int = 0
    batch_in_flight: int = 0


@dataclass
class ClusterView:
    """What a policy may look at on a tick (what the gateway and `/metrics` would say)."""

    now: float
    queued: int
    replicas: list[SimReplica]
    recent_waits_s: list[float]
    concurrency: int
    queued_batch: int = 0
    in_flight_batch: int = 0
    spilled_per_s: float = 0.0
    spilled_tokens_per_s: float = 0.0
    mean_service_s: float | None = None


@dataclass
class ScaleAction:
    desired: int
    victim: str | None = None
    reason: str = ""


class ScalingPolicy(Protocol):
    name: str

    def tick(self, view: ClusterView) -> ScaleAction: ...


@dataclass
class SimResult:
    policy: str
    waits_s: np.ndarray
    replica_hours: float
    batch_waits_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    spilled: int = 0
    spilled_tokens: int = 0
    timeline_s: list[float] = field(default_factory=list)
    timeline_replicas: list[int] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)

    def slo_attainment(self, target_s: float) -> float:
        """Share of interactive requests that waited at most `target_s` (spilled: no wait)."""
        if self.waits_s.size == 0:
            return 1.0
        return float(np.mean(self.waits_s <= target_s))


_DONE, _READY, _TICK, _DONE_BATCH = 0, 1, 2, 3


class _Sim:
    """One replay; `run` drives arrivals and events in time order, nothing sleeps."""

    def __init__(self, trace: Trace, cluster: ClusterSpec, policy: ScalingPolicy) -> None:
        self.trace, self.cluster, self.policy = trace, cluster, policy
        self.names = (f"r{i}" for i in itertools.count())
        self.replicas: dict[str, SimReplica] = {}
        self.events: list[tuple[float, int, int, str]] = []
        self.seq = itertools.count()
        self.queues: tuple[deque[int], deque[int]] = (deque(), deque())  # interactive, batch
        self.waits = np.full(trace.arrivals_s.size, np.nan)
        self.recent: deque[tuple[float, float]] = deque()  # (dispatched at, interactive wait)
        self.spills: deque[tuple[float, int]] = deque()  # (at, tokens)
        self.result = SimResult(policy=policy.name, waits_s=self.waits, replica_hours=0.0)
        self.last_t = 0.0
        self.mean_service = trace.mean_service_s

    def add_replica(self, now: float, warm: bool) -> None:
        name = next(self.names)
        state = ReplicaState.READY if warm else ReplicaState.STARTING
        self.replicas[name] = SimReplica(name=name, state=state, created_s=now)
        if not warm:
            heapq.heappush(
                self.events, (now + self.cluster.cold_start_s, next(self.seq), _READY, name)
            )

    def free_ready(self) -> list[SimReplica]:
        c = self.cluster.concurrency
        return [
            r for r in self.replicas.values() if r.state is ReplicaState.READY and r.in_flight < c
        ]

    def dispatch(self, now: float) -> None:
        for queue in self.queues:
            interactive = queue is self.queues[0]
            while queue:
                ready = self.free_ready()
                if not ready:
                    return
                target = min(ready, key=lambda r: r.in_flight)
                idx = queue.popleft()
                wait = now - float(self.trace.arrivals_s[idx])
                self.waits[idx] = wait
                if interactive:  # the gateway measures interactive waits only, as here
                    self.recent.append((now, wait))
                target.in_flight += 1
                target.batch_in_flight += not interactive
                done = now + float(self.trace.service_s[idx])
                kind = _DONE if interactive else _DONE_BATCH
                heapq.heappush(self.events, (done, next(self.seq), kind, target.name))

    def arrive(self, idx: int, now: float) -> None:
        batch = bool(self.trace.batch[idx])
        if not batch and self.cluster.spill.enabled and self.should_spill():
            self.waits[idx] = 0.0
            tokens = int(self.trace.tokens[idx])
            self.result.spilled += 1
            self.result.spilled_tokens += tokens
            self.spills.append((now, tokens))
            return
        self.queues[1 if batch else 0].append(idx)
        self.dispatch(now)

    def should_spill(self) -> bool:
        """Predicted wait of one more interactive request over the threshold: spill it."""
        if self.free_ready():
            return False
        ready = sum(1 for r in self.replicas.values() if r.state is ReplicaState.READY)
        slots = ready * self.cluster.concurrency
        if slots == 0:
            return True
        predicted = (len(self.queues[0]) + 1) * self.mean_service / slots
        return predicted > self.cluster.spill.wait_threshold_s

    def apply(self, now: float, action: ScaleAction) -> None:
        live = [r for r in self.replicas.values() if r.state is not ReplicaState.DRAINING]
        for _ in range(action.desired - len(live)):
            self.add_replica(now, warm=False)
        victim_name = action.victim
        for _ in range(len(live) - action.desired):
            live = [r for r in self.replicas.values() if r.state is not ReplicaState.DRAINING]
            victim = self.replicas.get(victim_name or "")
            if victim is None or victim.state is ReplicaState.DRAINING:
                victim = max(live, key=lambda r: r.created_s)  # newest first, like a ReplicaSet
            victim_name = None
            victim.state = ReplicaState.DRAINING
            if victim.in_flight == 0:
                del self.replicas[victim.name]

    def on_tick(self, now: float) -> None:
        window = self.cluster.latency_window_s
        while self.recent and self.recent[0][0] < now - window:
            self.recent.popleft()
        while self.spills and self.spills[0][0] < now - window:
            self.spills.popleft()
        view = ClusterView(
            now=now,
            queued=len(self.queues[0]) + len(self.queues[1]),
            queued_batch=len(self.queues[1]),
            in_flight_batch=sum(r.batch_in_flight for r in self.replicas.values()),
            replicas=list(self.replicas.values()),
            recent_waits_s=[w for _, w in self.recent],
            concurrency=self.cluster.concurrency,
            spilled_per_s=len(self.spills) / window,
            spilled_tokens_per_s=sum(t for _, t in self.spills) / window,
            mean_service_s=self.mean_service,
        )
        action = self.policy.tick(view)
        reasons = self.result.reasons
        reasons[action.reason] = reasons.get(action.reason, 0) + 1
        self.apply(now, action)
        self.record(now)
        if now + self.cluster.tick_s <= self.trace.duration_s:
            heapq.heappush(self.events, (now + self.cluster.tick_s, next(self.seq), _TICK, ""))

    def on_event(self, kind: int, name: str, now: float) -> None:
        if kind in (_DONE, _DONE_BATCH):
            replica = self.replicas[name]
            replica.in_flight -= 1
            replica.batch_in_flight -= kind == _DONE_BATCH
            if replica.state is ReplicaState.DRAINING and replica.in_flight == 0:
                del self.replicas[name]
        elif kind == _READY:
            if name in self.replicas and self.replicas[name].state is ReplicaState.STARTING:
                self.replicas[name].state = ReplicaState.READY
        else:
            self.on_tick(now)
        self.dispatch(now)

    def advance(self, to: float) -> None:
        self.result.replica_hours += len(self.replicas) * (to - self.last_t) / 3600.0
        self.last_t = to

    def record(self, now: float) -> None:
        r = self.result
        r.timeline_s.append(now)
        r.timeline_replicas.append(len(self.replicas))

    def run(self) -> SimResult:
        for _ in range(self.cluster.initial_replicas):
            self.add_replica(0.0, warm=True)
        heapq.heappush(self.events, (0.0, next(self.seq), _TICK, ""))
        arrivals, n, nxt = self.trace.arrivals_s, self.trace.arrivals_s.size, 0
        end = self.trace.duration_s
        while True:
            t_arrival = float(arrivals[nxt]) if nxt < n else None
            t_event = self.events[0][0] if self.events else None
            waiting = self.queues[0] or self.queues[1]
            if t_arrival is None and (t_event is None or (t_event > end and not waiting)):
                break
            if t_arrival is not None and (t_event is None or t_arrival <= t_event):
                self.advance(t_arrival)
                self.arrive(nxt, t_arrival)
                nxt += 1
                continue
            now, _, kind, name = heapq.heappop(self.events)
            self.advance(now)
            self.on_event(kind, name, now)
        batch = self.trace.batch.astype(bool)
        served = ~np.isnan(self.waits)
        self.result.waits_s = self.waits[served & ~batch]
        self.result.batch_waits_s = self.waits[served & batch]
        return self.result


def simulate(trace: Trace, cluster: ClusterSpec, policy: ScalingPolicy) -> SimResult:
    """Replay `trace` against `policy`; every time is simulated, nothing sleeps."""
    return _Sim(trace, cluster, policy).run()
