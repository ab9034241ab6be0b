"""The policies the simulator compares: ours (the real code), a fixed pool, and the three
autoscalers people deploy for LLMs today, each modelled on its documented algorithm."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from servefleet.autoscaler.policy import PolicyState, decide
from servefleet.autoscaler.signals import Observation, ReplicaLoad, ReplicaState
from servefleet.autoscaler.targets import ScalingTargets

from .sim_cluster import ClusterView, ScaleAction, SimReplica

LATENCY_QUANTILE = 0.9
HPA_SCALE_UP_PERIOD_S = 15.0


def observation_from_view(view: ClusterView) -> Observation:
    """What `observe` would scrape from the gateway and the engines' `/metrics`."""
    waits = sorted(view.recent_waits_s)
    wait = waits[int(LATENCY_QUANTILE * (len(waits) - 1))] if waits else None
    return Observation(
        gateway_queued=view.queued,
        gateway_queued_batch=view.queued_batch,
        in_flight_batch=view.in_flight_batch,
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
        spilled_per_s=view.spilled_per_s,
        spilled_tokens_per_s=view.spilled_tokens_per_s,
        mean_service_s=view.mean_service_s,
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


def _live(view: ClusterView) -> tuple[list[SimReplica], list[SimReplica]]:
    ready = [r for r in view.replicas if r.state is ReplicaState.READY]
    starting = [r for r in view.replicas if r.state is ReplicaState.STARTING]
    return ready, starting


def _live_count(view: ClusterView) -> int:
    """Replicas ready or starting: what the scalers compare their recommendation with."""
    return sum(r.state in (ReplicaState.READY, ReplicaState.STARTING) for r in view.replicas)


def _active_requests(view: ClusterView) -> int:
    """Queued plus in flight: the queue-length metric KEDA and KubeAI scale on."""
    return view.queued + sum(r.in_flight for r in view.replicas)


@dataclass
class HpaBehaviour:
    """kube-controller-manager's damping around any metric's raw recommendation: scale-down
    takes the highest recommendation over the stabilisation window; scale-up is limited to
    max(+100%, +4 pods) per 15 s."""

    min_replicas: int
    max_replicas: int
    stabilisation_s: float
    _recommendations: deque[tuple[float, int]] = field(default_factory=deque)
    _scaled_up: deque[tuple[float, int]] = field(default_factory=deque)

    def damp(self, now: float, raw: int, current: int) -> int:
        self._recommendations.append((now, raw))
        while self._recommendations and self._recommendations[0][0] < now - self.stabilisation_s:
            self._recommendations.popleft()
        desired = raw
        if raw < current:
            desired = min(current, max(r for _, r in self._recommendations))
        if desired > current:
            while self._scaled_up and self._scaled_up[0][0] < now - HPA_SCALE_UP_PERIOD_S:
                self._scaled_up.popleft()
            base = current - sum(n for _, n in self._scaled_up)
            desired = min(desired, max(2 * base, base + 4))
            if desired > current:
                self._scaled_up.append((now, desired - current))
        return min(max(desired, self.min_replicas), self.max_replicas)


@dataclass
class HpaPolicy:
    """The Kubernetes HPA on a utilisation metric (busy slots / slots).

    10% tolerance; on scale-up, not-yet-ready pods count as 0% busy. It sees no queue:
    utilisation saturates at 100% however long the queue grows, which is the point of the
    comparison.
    """

    target_utilisation: float
    min_replicas: int
    max_replicas: int
    stabilisation_s: float
    tolerance: float = 0.1
    name: str = "hpa"
    behaviour: HpaBehaviour = field(init=False)

    def __post_init__(self) -> None:
        self.behaviour = HpaBehaviour(self.min_replicas, self.max_replicas, self.stabilisation_s)

    def tick(self, view: ClusterView) -> ScaleAction:
        ready, starting = _live(view)
        current = len(ready) + len(starting)
        raw = self._raw_recommendation(view, ready, starting, current)
        return ScaleAction(desired=self.behaviour.damp(view.now, raw, current), reason="hpa")

    def _raw_recommendation(
        self, view: ClusterView, ready: list[SimReplica], starting: list[SimReplica], current: int
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


@dataclass
class KedaPolicy:
    """KEDA's queue-length scaler: an external metric (queued + in flight) with an
    `AverageValue` target per replica, fed to the same HPA damping; activation wakes 0 → 1."""

    target_per_replica: float
    min_replicas: int
    max_replicas: int
    stabilisation_s: float
    tolerance: float = 0.1
    name: str = "keda"
    behaviour: HpaBehaviour = field(init=False)

    def __post_init__(self) -> None:
        self.behaviour = HpaBehaviour(self.min_replicas, self.max_replicas, self.stabilisation_s)

    def tick(self, view: ClusterView) -> ScaleAction:
        current = _live_count(view)
        metric = _active_requests(view)
        if current == 0:
            return ScaleAction(desired=max(self.min_replicas, 1 if metric else 0), reason="keda")
        ratio = metric / (current * self.target_per_replica)
        raw = current if abs(ratio - 1) <= self.tolerance else math.ceil(ratio * current)
        return ScaleAction(desired=self.behaviour.damp(view.now, raw, current), reason="keda")


@dataclass
class KubeAiPolicy:
    """KubeAI's autoscaler: the moving average of active requests (queued + in flight) over
    a time window, divided by the target per replica; scale-down waits `scale_down_delay_s`."""

    target_per_replica: float
    min_replicas: int
    max_replicas: int
    window_s: float
    scale_down_delay_s: float
    name: str = "kubeai"
    _samples: deque[tuple[float, int]] = field(default_factory=deque)
    _low_since: float | None = None

    def tick(self, view: ClusterView) -> ScaleAction:
        self._samples.append((view.now, _active_requests(view)))
        while self._samples[0][0] < view.now - self.window_s:
            self._samples.popleft()
        average = sum(a for _, a in self._samples) / len(self._samples)
        current = _live_count(view)
        desired = math.ceil(average / self.target_per_replica)
        desired = min(max(desired, self.min_replicas), self.max_replicas)
        if desired < current:
            self._low_since = self._low_since if self._low_since is not None else view.now
            if view.now - self._low_since < self.scale_down_delay_s:
                desired = current
        else:
            self._low_since = None
        return ScaleAction(desired=desired, reason="kubeai")
