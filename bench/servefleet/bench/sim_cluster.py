"""Discrete-event model of one deployment: a gateway FIFO queue in front of a replica pool.

Each replica holds at most `concurrency` requests; a request occupies a slot for its service
time. New replicas serve after `cold_start_s`; a draining replica takes no new work and goes
away once empty. Replica-hours count every replica that exists (starting, ready, draining),
because that is what the GPUs cost.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from servefleet.autoscaler.signals import ReplicaState

from .sim_trace import Trace


class ClusterSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    concurrency: int = Field(default=8, ge=1, description="slots per replica")
    cold_start_s: float = Field(default=60.0, ge=0)
    initial_replicas: int = Field(default=1, ge=0)
    tick_s: float = Field(default=10.0, gt=0, description="autoscaler interval")
    latency_window_s: float = Field(default=30.0, gt=0, description="window of measured waits")


@dataclass
class SimReplica:
    name: str
    state: ReplicaState
    created_s: float
    in_flight: int = 0


@dataclass
class ClusterView:
    """What a policy may look at on a tick."""

    now: float
    queued: int
    replicas: list[SimReplica]
    recent_waits_s: list[float]
    concurrency: int


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
    timeline_s: list[float] = field(default_factory=list)
    timeline_replicas: list[int] = field(default_factory=list)
    timeline_ready: list[int] = field(default_factory=list)
    timeline_demand: list[int] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)

    def slo_attainment(self, target_s: float) -> float:
        if self.waits_s.size == 0:
            return 1.0
        return float(np.mean(self.waits_s <= target_s))


_DONE, _READY, _TICK = 0, 1, 2


def simulate(trace: Trace, cluster: ClusterSpec, policy: ScalingPolicy) -> SimResult:
    """Replay `trace` against `policy`; every time is simulated, nothing sleeps."""
    names = (f"r{i}" for i in itertools.count())
    replicas: dict[str, SimReplica] = {}
    events: list[tuple[float, int, int, str]] = []
    seq = itertools.count()
    queue: deque[tuple[float, float]] = deque()  # (arrival, service)
    waits = np.full(trace.arrivals_s.size, np.nan)
    recent: deque[tuple[float, float]] = deque()  # (dispatched at, wait)
    result = SimResult(policy=policy.name, waits_s=waits, replica_hours=0.0)
    index_of_queued: deque[int] = deque()
    last_t = 0.0

    def add_replica(now: float, warm: bool) -> None:
        name = next(names)
        state = ReplicaState.READY if warm else ReplicaState.STARTING
        replicas[name] = SimReplica(name=name, state=state, created_s=now)
        if not warm:
            heapq.heappush(events, (now + cluster.cold_start_s, next(seq), _READY, name))

    def dispatch(now: float) -> None:
        while queue:
            ready = [
                r
                for r in replicas.values()
                if r.state is ReplicaState.READY and r.in_flight < cluster.concurrency
            ]
            if not ready:
                return
            target = min(ready, key=lambda r: r.in_flight)
            arrival, service = queue.popleft()
            idx = index_of_queued.popleft()
            waits[idx] = now - arrival
            recent.append((now, now - arrival))
            target.in_flight += 1
            heapq.heappush(events, (now + service, next(seq), _DONE, target.name))

    def apply(now: float, action: ScaleAction) -> None:
        live = [r for r in replicas.values() if r.state is not ReplicaState.DRAINING]
        if action.desired > len(live):
            for _ in range(action.desired - len(live)):
                add_replica(now, warm=False)
        elif action.desired < len(live):
            for _ in range(len(live) - action.desired):
                live = [r for r in replicas.values() if r.state is not ReplicaState.DRAINING]
                victim = replicas.get(action.victim or "")
                if victim is None or victim.state is ReplicaState.DRAINING:
                    victim = max(live, key=lambda r: r.created_s)  # newest first, like a ReplicaSet
                action.victim = None
                victim.state = ReplicaState.DRAINING
                if victim.in_flight == 0:
                    del replicas[victim.name]

    for _ in range(cluster.initial_replicas):
        add_replica(0.0, warm=True)
    heapq.heappush(events, (0.0, next(seq), _TICK, ""))
    next_arrival = 0
    end = trace.spec.duration_s

    def advance(to: float) -> None:
        nonlocal last_t
        result.replica_hours += len(replicas) * (to - last_t) / 3600.0
        last_t = to

    while True:
        t_arrival = (
            float(trace.arrivals_s[next_arrival]) if next_arrival < trace.arrivals_s.size else None
        )
        t_event = events[0][0] if events else None
        if t_arrival is None and (t_event is None or (t_event > end and not queue)):
            break
        if t_arrival is not None and (t_event is None or t_arrival <= t_event):
            advance(t_arrival)
            queue.append((t_arrival, float(trace.service_s[next_arrival])))
            index_of_queued.append(next_arrival)
            next_arrival += 1
            dispatch(t_arrival)
            continue
        assert t_event is not None
        now, _, kind, name = heapq.heappop(events)
        advance(now)
        if kind == _DONE:
            replica = replicas[name]
            replica.in_flight -= 1
            if replica.state is ReplicaState.DRAINING and replica.in_flight == 0:
                del replicas[name]
        elif kind == _READY:
            if name in replicas and replicas[name].state is ReplicaState.STARTING:
                replicas[name].state = ReplicaState.READY
        elif kind == _TICK:
            while recent and recent[0][0] < now - cluster.latency_window_s:
                recent.popleft()
            view = ClusterView(
                now=now,
                queued=len(queue),
                replicas=list(replicas.values()),
                recent_waits_s=[w for _, w in recent],
                concurrency=cluster.concurrency,
            )
            action = policy.tick(view)
            result.reasons[action.reason] = result.reasons.get(action.reason, 0) + 1
            apply(now, action)
            _record(result, now, replicas, len(queue))
            if now + cluster.tick_s <= end:
                heapq.heappush(events, (now + cluster.tick_s, next(seq), _TICK, ""))
        dispatch(now)

    result.waits_s = waits[~np.isnan(waits)]
    return result


def _record(result: SimResult, now: float, replicas: dict[str, SimReplica], queued: int) -> None:
    result.timeline_s.append(now)
    result.timeline_replicas.append(len(replicas))
    result.timeline_ready.append(sum(1 for r in replicas.values() if r.state is ReplicaState.READY))
    result.timeline_demand.append(queued + sum(r.in_flight for r in replicas.values()))


PolicyFactory = Callable[[], ScalingPolicy]
