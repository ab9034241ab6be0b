"""The three policies the simulator compares: ours (the real code), a fixed pool, HPA-style."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from servefleet.autoscaler.policy import PolicyState, decide
from servefleet.autoscaler.signals import Observation, ReplicaLoad, ReplicaState
from servefleet.autoscaler.targets import ScalingTargets

from .sim_cluster import ClusterView, ScaleAction

LATENCY_QUANTILE = 0.9


def observation_from_view(view: ClusterView) -> Observation:
    """What `observe` would scrape from the gateway and the engines' `/metrics`."""
    waits = sorted(view.recent_waits_s)
    wait = waits[int(LATENCY_QUANTILE * (len(waits) - 1))] if waits else None
    return Observation(
        gateway_queued=view.queued,
        replicas=tuple(
            ReplicaLoad(
                name=r.name,
                state=r.state,
                running=r.in_flight,
                kv_cache_usage=min(1.0, r.in_flight / view.concurrency),
            )
            for r in view.replicas
        ),
        queue_wait_s=wait,
    )


@dataclass
class ServefleetPolicy:
    """Runs `servefleet.autoscaler.policy.decide`, unchanged, on the simulated clock."""

    targets: ScalingTargets
    name: str = "servefleet"
    state: PolicyState = field(default_factory=PolicyState)

    def tick(self, view: ClusterView) -> ScaleAction:
        decision = decide(observation_from_view(view), self.targets, view.now, self.state)
        self.state = decision.state
        return ScaleAction(desired=decision.desired, victim=decision.victim, reason=decision.reason)


@dataclass
class FixedPolicy:
    replicas: int
    name: str = "fixed"

    def tick(self, view: ClusterView) -> ScaleAction:
        return ScaleAction(desired=self.replicas, reason="fixed")


@dataclass
class HpaPolicy:
    """The Kubernetes HPA algorithm on a utilisation metric (busy slots / slots).

    Follows kube-controller-manager: 10% tolerance; on scale-up, not-yet-ready pods count as
    0% busy; scale-down takes the highest recommendation over the stabilisation window;
    scale-up is limited to max(+100%, +4 pods) per 15 s. It sees no queue: utilisation
    saturates at 100% however long the queue grows, which is the point of the comparison.
    """

    target_utilisation: float
    min_replicas: int
    max_replicas: int
    stabilisation_s: float
    tolerance: float = 0.1
    name: str = "hpa"
    _recommendations: deque[tuple[float, int]] = field(default_factory=deque)
    _scaled_up: deque[tuple[float, int]] = field(default_factory=deque)

    def tick(self, view: ClusterView) -> ScaleAction:
        ready = [r for r in view.replicas if r.state is ReplicaState.READY]
        starting = [r for r in view.replicas if r.state is ReplicaState.STARTING]
        current = len(ready) + len(starting)
        raw = self._raw_recommendation(view, ready, starting, current)
        self._recommendations.append((view.now, raw))
        while (
            self._recommendations and self._recommendations[0][0] < view.now - self.stabilisation_s
        ):
            self._recommendations.popleft()
        desired = raw
        if raw < current:
            desired = min(current, max(r for _, r in self._recommendations))
        if desired > current:
            while self._scaled_up and self._scaled_up[0][0] < view.now - 15.0:
                self._scaled_up.popleft()
            base = current - sum(n for _, n in self._scaled_up)
            desired = min(desired, max(2 * base, base + 4))
            if desired > current:
                self._scaled_up.append((view.now, desired - current))
        desired = min(max(desired, self.min_replicas), self.max_replicas)
        return ScaleAction(desired=desired, reason="hpa")

    def _raw_recommendation(
        self, view: ClusterView, ready: list, starting: list, current: int
    ) -> int:
        if not ready:
            return current
        busy = sum(min(r.in_flight, view.concurrency) / view.concurrency for r in ready)
        ratio = busy / (len(ready) * self.target_utilisation)
        if abs(ratio - 1) <= self.tolerance:
            return current
        if ratio > 1 and starting:
            ratio = busy / ((len(ready) + len(starting)) * self.target_utilisation)
            if ratio <= 1 + self.tolerance:
                return current
            return math.ceil(ratio * (len(ready) + len(starting)))
        return math.ceil(ratio * len(ready))
