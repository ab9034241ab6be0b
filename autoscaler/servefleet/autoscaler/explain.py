"""Why a decision is what it is: a metric label (`Reason`) and a sentence a person can check.

The sentence carries the numbers the rule compared, e.g.
"up 2→4: queue 37, queue wait 9.5 s > target 2 s, cold start 41 s", so an Event, a log
line or a console shows the decision without anyone reading the policy's code.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from .targets import ScalingTargets


class Reason(StrEnum):
    """Why the desired replica count is what it is; exported as a metric label and Event."""

    STEADY = "steady"
    DEMAND = "demand"
    PREDICTED_GROWTH = "predicted_growth"
    LATENCY_OVER_TARGET = "latency_over_target"
    SPILL_COSTS_MORE = "spill_costs_more"
    SPILLING = "spilling"
    WAKE_FROM_ZERO = "wake_from_zero"
    BELOW_MIN = "below_min_replicas"
    ABOVE_MAX = "above_max_replicas"
    NO_CAPACITY = "no_capacity"
    SIGNALS_UNKNOWN = "signals_unknown"
    SCALE_DOWN_DELAY = "scale_down_delay"
    WAITING_FOR_DRAIN = "waiting_for_drain"
    WAITING_FOR_START = "waiting_for_start"
    SCALE_DOWN = "scale_down"
    BATCH_DEADLINE = "batch_deadline"


class Facts(BaseModel):
    """The numbers a decision was taken on, as the sentence quotes them."""

    model_config = ConfigDict(frozen=True)

    current: int
    demand: float
    level: float
    prior_level: float
    burst: bool
    waiting: int
    queued: int
    queue_wait_s: float | None
    ttft_s: float | None
    trend_per_s: float
    cold_start_s: float
    unavailable: int
    wanted: int
    unknown: tuple[str, ...]
    spilled_per_s: float
    spill_spend: float
    spill_budget: float
    asked_within_delay: int
    batch_lines_per_s: float = 0.0
    batch_replicas: int = 0


def describe(reason: Reason, desired: int, facts: Facts, targets: ScalingTargets) -> str:
    """ "up 2→4: …", "down 3→2: …" or "hold 3: …", then the rule's own numbers."""
    if desired > facts.current:
        head = f"up {facts.current}→{desired}"
    elif desired < facts.current:
        head = f"down {facts.current}→{desired}"
    else:
        head = f"hold {facts.current}"
    detail = _DETAILS[reason](facts, targets)
    if facts.unavailable and reason is not Reason.NO_CAPACITY:
        detail += f"; {facts.unavailable} pending over {targets.pending_patience_s:g} s"
    return f"{head}: {detail}"


def _latency(f: Facts, t: ScalingTargets) -> str:
    parts = [f"queue {f.waiting}"]
    wait, wait_target = f.queue_wait_s, t.queue_wait_target_s
    if wait is not None and wait_target is not None and wait > wait_target:
        parts.append(f"queue wait {wait:.1f} s > target {wait_target:g} s")
    if f.ttft_s is not None and t.ttft_target_s is not None and f.ttft_s > t.ttft_target_s:
        parts.append(f"TTFT {f.ttft_s:.1f} s > target {t.ttft_target_s:g} s")
    parts.append(f"cold start {f.cold_start_s:.0f} s")
    return ", ".join(parts)


def _no_capacity(f: Facts, t: ScalingTargets) -> str:
    why = (
        f"{f.unavailable} pending over {t.pending_patience_s:g} s"
        if f.unavailable
        else "no free capacity"
    )
    return f"demand {f.demand:.0f} wants {f.wanted}, {why}"


def _level(f: Facts, t: ScalingTargets) -> str:
    return f"demand {f.level:.1f} at {t.target_per_replica:g} per replica"


def _demand(f: Facts, t: ScalingTargets) -> str:
    if f.burst:  # sized on the latest sample: it jumped far above the recent level
        return (
            f"queue {f.waiting}, demand {f.demand:.0f} jumped from {f.prior_level:.0f}, "
            f"cold start {f.cold_start_s:.0f} s"
        )
    return _level(f, t)


_DETAILS: dict[Reason, Callable[[Facts, ScalingTargets], str]] = {
    Reason.STEADY: _level,
    Reason.DEMAND: _demand,
    Reason.PREDICTED_GROWTH: lambda f, t: (
        f"demand {f.demand:.0f} rising {f.trend_per_s:.2f}/s over a cold start of "
        f"{f.cold_start_s:.0f} s"
    ),
    Reason.LATENCY_OVER_TARGET: _latency,
    Reason.SPILL_COSTS_MORE: lambda f, t: (
        f"spilling {f.spilled_per_s:.1f} req/s has cost {f.spill_spend:.2f}, more than the "
        f"{f.spill_budget:.2f} its replicas cost at least"
    ),
    Reason.SPILLING: lambda f, t: (
        f"spilling {f.spilled_per_s:.1f} req/s ({f.spill_spend:.2f} so far) is cheaper than "
        f"replicas ({f.spill_budget:.2f} at least)"
    ),
    Reason.WAKE_FROM_ZERO: lambda f, t: f"{f.queued} requests queued, no replica",
    Reason.BELOW_MIN: lambda f, t: f"warm pool is {t.min_replicas}",
    Reason.ABOVE_MAX: lambda f, t: f"maximum is {t.max_replicas}",
    Reason.NO_CAPACITY: _no_capacity,
    Reason.SIGNALS_UNKNOWN: lambda f, t: (
        (f"unknown {', '.join(f.unknown)}" if f.unknown else "metrics too old")
        + ", unknown is not zero"
    ),
    Reason.SCALE_DOWN_DELAY: lambda f, t: (
        f"demand asked for {f.asked_within_delay} within the last {t.scale_down_delay_s:g} s"
    ),
    Reason.WAITING_FOR_DRAIN: lambda f, t: "a replica is still draining",
    Reason.WAITING_FOR_START: lambda f, t: "a replica is still starting, never stopped unready",
    Reason.BATCH_DEADLINE: lambda f, t: (
        f"open batches need {f.batch_lines_per_s:.2f} lines/s to meet their deadlines: "
        f"{f.batch_replicas} replicas at {t.batch_slots_per_replica} batch slots each"
    ),
    Reason.SCALE_DOWN: lambda f, t: (
        f"demand {f.level:.1f} needed fewer for {t.scale_down_delay_s:g} s"
    ),
}
