"""The scaling decision, as a pure function of what was observed and what was decided before.

No I/O and no wall clock: the controller and the simulator both call `decide` with their own
clock, so what the simulator measures is exactly what runs in production.
"""

from __future__ import annotations

import math
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from .signals import Observation, ReplicaState
from .targets import ScalingTargets
from .victim import pick_victim

TREND_WINDOW_S = 60.0
"""Demand history used to fit the growth trend; long enough to average out Poisson noise."""
MIN_TREND_SAMPLES = 4
TREND_SIGNIFICANCE = 2.0
"""A trend counts only when its slope exceeds this many standard errors."""
COLD_START_SMOOTHING = 0.5
"""Weight of the newest cold-start measurement in its running average."""


class Reason(StrEnum):
    """Why the desired replica count is what it is; exported as a metric label and Event."""

    STEADY = "steady"
    DEMAND = "demand"
    PREDICTED_GROWTH = "predicted_growth"
    LATENCY_OVER_TARGET = "latency_over_target"
    WAKE_FROM_ZERO = "wake_from_zero"
    BELOW_MIN = "below_min_replicas"
    ABOVE_MAX = "above_max_replicas"
    SCALE_DOWN_DELAY = "scale_down_delay"
    WAITING_FOR_DRAIN = "waiting_for_drain"
    SCALE_DOWN = "scale_down"


class PolicyState(BaseModel):
    """What the policy remembers between ticks. Returned anew by every decision."""

    model_config = ConfigDict(frozen=True)

    first_seen: float | None = Field(default=None, description="time of the first decision")
    recommendations: tuple[tuple[float, int], ...] = Field(
        default=(), description="(time, size demand asked for) over the scale-down delay"
    )
    demand_history: tuple[tuple[float, int], ...] = ()
    starting_since: dict[str, float] = Field(default_factory=dict)
    cold_start_s: float | None = Field(default=None, description="measured, smoothed")


class Decision(BaseModel):
    """The desired size, why, and — on scale-down — which replica should go."""

    model_config = ConfigDict(frozen=True)

    desired: int
    current: int
    reason: Reason
    victim: str | None = None
    demand: int = 0
    demand_trend_per_s: float = 0.0
    cold_start_s: float = 0.0
    state: PolicyState


def decide(
    observation: Observation,
    targets: ScalingTargets,
    now: float,
    state: PolicyState | None = None,
) -> Decision:
    """Desired replicas for one deployment at time `now` (seconds, any epoch)."""
    state = state or PolicyState()
    starting_since, cold_start = _track_cold_starts(observation, now, state)
    history = _append_history(state.demand_history, now, observation.demand)
    trend = _demand_trend(history)
    cold = cold_start if cold_start is not None else targets.default_cold_start_s

    current = observation.count(ReplicaState.READY) + observation.count(ReplicaState.STARTING)
    up, up_reason = _scale_up_target(observation, targets, current, trend, cold)
    first_seen = state.first_seen if state.first_seen is not None else now
    # Scale-up acts on the latest sample; scale-down on the window mean, so that Poisson
    # jitter in a flat load does not pin the pool at the noise peaks for the whole delay.
    settled = min(
        up, _clamp(math.ceil(_mean_demand(history) / targets.target_per_replica), targets)
    )
    recent = (r for r in state.recommendations if now - r[0] < targets.scale_down_delay_s)
    recommendations = (*recent, (now, settled))
    new_state = PolicyState(
        first_seen=first_seen,
        recommendations=recommendations,
        demand_history=history,
        starting_since=starting_since,
        cold_start_s=cold_start,
    )

    def out(desired: int, reason: Reason, victim: str | None = None) -> Decision:
        return Decision(
            desired=desired,
            current=current,
            reason=reason,
            victim=victim,
            demand=observation.demand,
            demand_trend_per_s=trend,
            cold_start_s=cold,
            state=new_state,
        )

    if current < targets.min_replicas:
        return out(max(up, targets.min_replicas), Reason.BELOW_MIN)
    if current > targets.max_replicas:
        victim = pick_victim(observation.replicas)
        return out(targets.max_replicas, Reason.ABOVE_MAX, victim.name if victim else None)
    if up > current:
        return out(up, up_reason)
    if up == current:
        return out(current, Reason.STEADY)

    # Demand stayed low for the delay when no recommendation within it asked for this size.
    stayed_low = now - first_seen >= targets.scale_down_delay_s and all(
        n < current for _, n in recommendations
    )
    if not stayed_low:
        return out(current, Reason.SCALE_DOWN_DELAY)
    if observation.count(ReplicaState.DRAINING) > 0:
        return out(current, Reason.WAITING_FOR_DRAIN)
    victim = pick_victim(observation.replicas)
    return out(current - 1, Reason.SCALE_DOWN, victim.name if victim else None)


def _scale_up_target(
    observation: Observation,
    targets: ScalingTargets,
    current: int,
    trend: float,
    cold_start_s: float,
) -> tuple[int, Reason]:
    """The largest size any scale-up rule asks for, clamped, and the rule that asked."""
    demand = observation.demand
    size = math.ceil(demand / targets.target_per_replica)
    reason = Reason.WAKE_FROM_ZERO if current == 0 and demand > 0 else Reason.DEMAND

    starting = observation.count(ReplicaState.STARTING)
    if starting == 0 and _waiting_would_miss_target(targets, trend, cold_start_s):
        projected = demand + trend * cold_start_s
        ahead = math.ceil(projected / targets.target_per_replica)
        if ahead > max(size, current):
            size, reason = ahead, Reason.PREDICTED_GROWTH

    if starting == 0 and _latency_over_target(observation, targets) and current + 1 > size:
        size, reason = current + 1, Reason.LATENCY_OVER_TARGET

    return _clamp(size, targets), reason


def _clamp(size: int, targets: ScalingTargets) -> int:
    return min(max(size, targets.min_replicas), targets.max_replicas)


def _mean_demand(history: tuple[tuple[float, int], ...]) -> float:
    return sum(d for _, d in history) / len(history)


def _waiting_would_miss_target(targets: ScalingTargets, trend: float, cold_start_s: float) -> bool:
    """Reacting only once the queue is there means its requests wait about one cold start.

    So when a cold start is longer than the queue-wait target and demand is rising by more
    than one replica's worth during one cold start, capacity has to be bought ahead.
    """
    if trend <= 0:
        return False
    if targets.queue_wait_target_s is not None and cold_start_s <= targets.queue_wait_target_s:
        return False
    return trend * cold_start_s >= targets.target_per_replica


def _latency_over_target(observation: Observation, targets: ScalingTargets) -> bool:
    """Measured latency is a window into the past: it only argues for capacity while there is
    demand now, or a burst that has ended would keep the pool from ever shrinking."""
    if observation.demand <= 0:
        return False
    wait, wait_target = observation.queue_wait_s, targets.queue_wait_target_s
    ttft, ttft_target = observation.ttft_s, targets.ttft_target_s
    return (wait is not None and wait_target is not None and wait > wait_target) or (
        ttft is not None and ttft_target is not None and ttft > ttft_target
    )


def _track_cold_starts(
    observation: Observation, now: float, state: PolicyState
) -> tuple[dict[str, float], float | None]:
    """Note when replicas start, and time those that became ready since the last tick."""
    cold_start = state.cold_start_s
    starting_since: dict[str, float] = {}
    for replica in observation.replicas:
        since = state.starting_since.get(replica.name)
        if replica.state is ReplicaState.STARTING:
            starting_since[replica.name] = since if since is not None else now
        elif replica.state is ReplicaState.READY and since is not None:
            measured = now - since
            cold_start = (
                measured
                if cold_start is None
                else COLD_START_SMOOTHING * measured + (1 - COLD_START_SMOOTHING) * cold_start
            )
    return starting_since, cold_start


def _append_history(
    history: tuple[tuple[float, int], ...], now: float, demand: int
) -> tuple[tuple[float, int], ...]:
    kept = tuple((t, d) for t, d in history if now - t <= TREND_WINDOW_S and t < now)
    return (*kept, (now, demand))


def _demand_trend(history: tuple[tuple[float, int], ...]) -> float:
    """Least-squares slope of demand over the window, in requests per second.

    Returns 0 unless the slope is clearly above the noise (two standard errors), so Poisson
    jitter in a flat load does not buy replicas ahead of time.
    """
    n = len(history)
    if n < MIN_TREND_SAMPLES:
        return 0.0
    mean_t = sum(t for t, _ in history) / n
    mean_d = sum(d for _, d in history) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in history)
    if var_t == 0:
        return 0.0
    slope = sum((t - mean_t) * (d - mean_d) for t, d in history) / var_t
    residual = sum((d - mean_d - slope * (t - mean_t)) ** 2 for t, d in history)
    stderr = math.sqrt(residual / (n - 2) / var_t)
    return slope if slope > TREND_SIGNIFICANCE * stderr else 0.0
