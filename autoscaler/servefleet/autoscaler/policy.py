"""The scaling decision, as a pure function of what was observed and what was decided before.

No I/O and no wall clock: the controller and the simulator both call `decide` with their own
clock, so what the simulator measures is exactly what runs in production.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from . import demand as dm
from .batch_deadline import batch_replicas
from .explain import Facts, Reason, describe
from .signals import Observation, ReplicaState
from .targets import ScalingTargets
from .victim import pick_victim

__all__ = ["Decision", "PolicyState", "Reason", "decide"]

COLD_START_SMOOTHING = 0.5
"""Weight of the newest cold-start measurement in its running average."""


class PolicyState(BaseModel):
    """What the policy remembers between ticks. Returned anew by every decision."""

    model_config = ConfigDict(frozen=True)

    first_seen: float | None = Field(default=None, description="time of the first decision")
    last_tick: float | None = None
    recommendations: tuple[tuple[float, int], ...] = Field(
        default=(), description="(time, size asked for) over the scale-down delay"
    )
    demand_history: dm.History = ()
    starting_since: dict[str, float] = Field(
        default_factory=dict, description="pending or starting replicas: since when"
    )
    cold_start_s: float | None = Field(default=None, description="measured, smoothed")
    spill_spend: float = Field(default=0.0, description="spent on the current spill-over")
    last_spill_at: float | None = Field(default=None, description="when spill-over was last seen")


class Decision(BaseModel):
    """The desired size, why (as a label and as a sentence), and which replica should go."""

    model_config = ConfigDict(frozen=True)

    desired: int
    current: int
    reason: Reason
    message: str = ""
    victim: str | None = None
    demand: int = 0
    demand_trend_per_s: float = 0.0
    cold_start_s: float = 0.0
    unavailable: int = Field(default=0, description="replicas pending past their patience")
    state: PolicyState


class _Tick(BaseModel):
    """Everything derived from one observation that the rules read."""

    model_config = ConfigDict(frozen=True)

    now: float
    current: int
    coming: int
    unavailable: int
    headroom: int | None
    known: bool
    fresh: bool
    sample: float
    sample_size: int
    level: float
    prior_level: float
    burst: bool
    trend: float
    fitted: float
    cold_start_s: float
    waiting: int
    spill_budget: float
    spill_bought: bool
    renting_recently: bool
    batch: int  # replicas the open batches' deadlines need (0: none)


def decide(
    observation: Observation,
    targets: ScalingTargets,
    now: float,
    state: PolicyState | None = None,
) -> Decision:
    """Desired replicas for one deployment at time `now` (seconds, any epoch)."""
    state = state or PolicyState()
    tick, new_state = _observe(observation, targets, now, state)
    up, up_reason, wanted = _scale_up_target(observation, targets, tick)
    recommendation = math.ceil(dm.with_headroom(tick.level) / targets.target_per_replica)
    recommendation = max(recommendation, tick.batch)  # a batch's deadline holds the pool
    if not tick.known:
        recommendation = tick.current  # unknown is not zero: it asks for what there is
    # A scale-up is itself a recommendation, so the delay holds after every one of them.
    asked = up if up > tick.current else recommendation
    recent = (r for r in state.recommendations if now - r[0] < targets.scale_down_delay_s)
    recommendations = (*recent, (now, _clamp_to(asked, targets)))
    new_state = new_state.model_copy(update={"recommendations": recommendations})
    facts = Facts(
        current=tick.current,
        demand=tick.sample,
        level=tick.level,
        prior_level=tick.prior_level,
        burst=tick.burst,
        waiting=tick.waiting,
        queued=observation.gateway_queued,
        queue_wait_s=observation.queue_wait_s,
        ttft_s=observation.ttft_s,
        trend_per_s=tick.trend,
        cold_start_s=tick.cold_start_s,
        unavailable=tick.unavailable,
        wanted=wanted,
        unknown=observation.unknown,
        spilled_per_s=observation.spilled_per_s,
        spill_spend=new_state.spill_spend,
        spill_budget=tick.spill_budget,
        asked_within_delay=max(n for _, n in recommendations),
        batch_lines_per_s=observation.batch_lines_per_s_needed,
        batch_replicas=tick.batch,
    )

    desired, reason, victim = _choose(
        observation, targets, tick, (up, up_reason), (_first_seen(new_state, now), recommendations)
    )
    return Decision(
        desired=desired,
        current=tick.current,
        reason=reason,
        message=describe(reason, desired, facts, targets),
        victim=victim,
        demand=math.ceil(tick.sample),
        demand_trend_per_s=tick.trend,
        cold_start_s=tick.cold_start_s,
        unavailable=tick.unavailable,
        state=new_state,
    )


def _choose(
    observation: Observation,
    targets: ScalingTargets,
    tick: _Tick,
    scale_up: tuple[int, Reason],
    memory: tuple[float, tuple[tuple[float, int], ...]],
) -> tuple[int, Reason, str | None]:
    """The rules in order; the first that applies decides."""
    (up, up_reason), (first_seen, recommendations) = scale_up, memory
    current = tick.current
    if current < targets.min_replicas:
        return max(up, targets.min_replicas), Reason.BELOW_MIN, None
    if current > targets.max_replicas:
        victim = pick_victim(observation.replicas)
        return targets.max_replicas, Reason.ABOVE_MAX, victim.name if victim else None
    if not tick.fresh:
        return current, Reason.SIGNALS_UNKNOWN, None
    if up > current:
        return up, up_reason, None
    if up_reason is Reason.NO_CAPACITY:
        return current, Reason.NO_CAPACITY, None
    if min(up, tick.sample_size) >= current:
        return current, Reason.SPILLING if observation.spilled_per_s > 0 else Reason.STEADY, None
    if tick.batch >= current:
        return current, Reason.BATCH_DEADLINE, None
    if not tick.known:
        return current, Reason.SIGNALS_UNKNOWN, None
    # Demand stayed low for the delay when no recommendation within it asked for this size.
    stayed_low = tick.now - first_seen >= targets.scale_down_delay_s and all(
        n < current for _, n in recommendations
    )
    if not stayed_low:
        return current, Reason.SCALE_DOWN_DELAY, None
    if observation.count(ReplicaState.DRAINING) > 0:
        return current, Reason.WAITING_FOR_DRAIN, None
    if observation.count(ReplicaState.STARTING) > 0:
        # A replica is never stopped before it was ready: its cold start is already paid.
        return current, Reason.WAITING_FOR_START, None
    victim = pick_victim(observation.replicas)
    return current - 1, Reason.SCALE_DOWN, victim.name if victim else None


def _observe(
    observation: Observation, targets: ScalingTargets, now: float, state: PolicyState
) -> tuple[_Tick, PolicyState]:
    """Turn one observation (and the memory) into the numbers the rules use."""
    starting_since, cold_start = _track_cold_starts(observation, now, state)
    cold = cold_start if cold_start is not None else targets.default_cold_start_s
    fresh = observation.observed_at is None or (
        now - observation.observed_at <= targets.signal_max_age_s
    )
    known = fresh and not observation.unknown
    spend, budget = _spill_spend(observation, targets, now, state, cold)
    bought = not targets.prices_spill or spend >= budget * (1 - 1e-9)  # float sums
    last_spill = now if observation.spilled_per_s > 0 else state.last_spill_at
    sample = dm.interactive_demand(observation, count_spilled=bought)
    window_s = dm.level_window_s(targets.scale_down_delay_s)
    prior = dm.window(state.demand_history, now, window_s)
    history = dm.append_history(state.demand_history, now, sample, window_s) if known else prior
    unavailable = _unavailable(observation, targets, now, starting_since)
    trend = dm.demand_trend(history)
    prior_level = dm.mean_level(prior) if prior else sample
    coming = observation.count(ReplicaState.STARTING) + observation.count(ReplicaState.PENDING)
    headroom = 0 if unavailable else observation.free_capacity
    waiting = dm.waiting(observation)
    tick = _Tick(
        now=now,
        current=len(observation.replicas) - observation.count(ReplicaState.DRAINING),
        coming=coming - unavailable,
        unavailable=unavailable,
        headroom=headroom,
        known=known,
        fresh=fresh,
        sample=sample,
        sample_size=_clamp_to(math.ceil(sample / targets.target_per_replica), targets),
        level=dm.mean_level(history) if history else sample,
        prior_level=prior_level,
        burst=waiting > 0 and dm.is_burst(sample, prior_level),
        trend=trend,
        fitted=dm.fitted_now(history, trend) if history else sample,
        cold_start_s=cold,
        waiting=waiting,
        spill_budget=budget,
        spill_bought=bought,
        renting_recently=targets.prices_spill
        and _spilled_within(last_spill, now, window_s)
        and (observation.spilled_per_s <= 0 or not bought),
        batch=batch_replicas(observation, targets) if known else 0,
    )
    new_state = PolicyState(
        first_seen=_first_seen(state, now),
        last_tick=now,
        demand_history=history,
        starting_since=starting_since,
        cold_start_s=cold_start,
        spill_spend=spend,
        last_spill_at=last_spill,
    )
    return tick, new_state


def _unavailable(
    observation: Observation, targets: ScalingTargets, now: float, starting_since: dict[str, float]
) -> int:
    """Pending replicas asked for longer ago than their patience: they may never come."""
    return sum(
        1
        for r in observation.replicas
        if r.state is ReplicaState.PENDING
        and now - starting_since.get(r.name, now) > targets.pending_patience_s
    )


def _scale_up_target(
    observation: Observation, targets: ScalingTargets, tick: _Tick
) -> tuple[int, Reason, int]:
    """The size the scale-up rules ask for (capped by capacity), the rule, and the uncapped want.

    Sizes are absolute, so a burst jumps straight to what it needs. Rules that react to a
    symptom (trend, latency) stay quiet while replicas are still coming.
    """
    tpr = targets.target_per_replica
    size = math.ceil(tick.level / tpr)
    reason = Reason.DEMAND
    if tick.burst:
        size = math.ceil(tick.sample / tpr)
    if observation.spilled_per_s > 0 and tick.spill_bought and targets.prices_spill:
        size, reason = max(size, math.ceil(tick.sample / tpr)), Reason.SPILL_COSTS_MORE
    if tick.current == 0 and (tick.sample > 0 or observation.gateway_queued_batch > 0):
        size, reason = max(size, 1), Reason.WAKE_FROM_ZERO
    if tick.coming == 0 and _waiting_would_miss_target(targets, tick):
        projected = tick.fitted + tick.trend * tick.cold_start_s
        # Only growth that outruns the pool by more than noise buys ahead.
        beyond_noise = projected > tick.current * tpr + dm.noise_margin(tick.level)
        ahead = math.ceil(projected / tpr)
        if beyond_noise and ahead > max(size, tick.current):
            size, reason = ahead, Reason.PREDICTED_GROWTH
    if (
        tick.coming == 0
        and not tick.renting_recently  # priced spill-over took the overflow: rent-or-buy decides
        and _more_replicas_help(observation, tick)
        and _latency_over_target(observation, targets)
    ):
        needed = max(tick.current + 1, math.ceil(tick.sample / tpr))
        if needed > size:
            size, reason = needed, Reason.LATENCY_OVER_TARGET
    if _renting(observation, targets, tick) and size > tick.current:
        size, reason = tick.current, Reason.SPILLING
    if tick.batch > max(size, tick.current):  # batch work waits for replicas, never spills
        size, reason = tick.batch, Reason.BATCH_DEADLINE
    wanted = _clamp_to(size, targets)
    if tick.headroom is not None and wanted > tick.current + tick.headroom:
        capped = max(tick.current + tick.headroom, tick.current)
        if capped <= tick.current:
            return tick.current, Reason.NO_CAPACITY, wanted
        return capped, reason, wanted
    return wanted, reason, wanted


def _renting(observation: Observation, targets: ScalingTargets, tick: _Tick) -> bool:
    """The hosted API is taking the overflow and has cost less than replicas would: while that
    holds, a full pool is not a reason to buy (the spike may end before they are ready)."""
    return (
        targets.prices_spill
        and observation.spilled_per_s > 0
        and not tick.spill_bought
        and tick.current > 0
    )


def _spilled_within(last_spill: float | None, now: float, window_s: float) -> bool:
    """Spilling now, or paused for less than the level window: still the same spill-over."""
    return last_spill is not None and now - last_spill <= window_s


def _first_seen(state: PolicyState, now: float) -> float:
    return state.first_seen if state.first_seen is not None else now


def _clamp_to(size: int, targets: ScalingTargets) -> int:
    return min(max(size, targets.min_replicas), targets.max_replicas)


def _waiting_would_miss_target(targets: ScalingTargets, tick: _Tick) -> bool:
    """Reacting only once the queue is there means its requests wait about one cold start.

    So when a cold start is longer than the queue-wait target and demand is rising by more
    than one replica's worth during one cold start, capacity has to be bought ahead.
    """
    if tick.trend <= 0:
        return False
    wait_target = targets.queue_wait_target_s
    if wait_target is not None and tick.cold_start_s <= wait_target:
        return False
    return tick.trend * tick.cold_start_s >= targets.target_per_replica


def _more_replicas_help(observation: Observation, tick: _Tick) -> bool:
    """Latency falls with more replicas only if requests wait for a slot or share one replica's
    batch. One request at a time on each replica that is slow is slow because of the machine
    (a busy CPU, a long prompt): another replica on the same machine makes it worse."""
    ready = observation.count(ReplicaState.READY)
    in_flight = sum(r.in_flight for r in observation.replicas if r.state is ReplicaState.READY)
    return tick.waiting > 0 or in_flight > ready


def _latency_over_target(observation: Observation, targets: ScalingTargets) -> bool:
    """Measured latency is a window into the past: the caller also checks that more replicas
    would help now, or a burst that has ended would keep the pool from ever shrinking."""
    wait, wait_target = observation.queue_wait_s, targets.queue_wait_target_s
    ttft, ttft_target = observation.ttft_s, targets.ttft_target_s
    return (wait is not None and wait_target is not None and wait > wait_target) or (
        ttft is not None and ttft_target is not None and ttft > ttft_target
    )


def _spill_spend(
    observation: Observation,
    targets: ScalingTargets,
    now: float,
    state: PolicyState,
    cold_start_s: float,
) -> tuple[float, float]:
    """Rent or buy: what the current spill-over has cost, and what buying its replicas would.

    A replica bought now costs at least a cold start plus the scale-down delay, and arrives a
    cold start late; so spill-over continues until it has cost that much (the classic
    rent-or-buy rule, never worse than twice the best choice in hindsight). A spike shorter
    than that is served by the hosted API alone. `spill_patience` scales that budget, for
    traffic whose bursts are known to be shorter (or longer) than a cold start.
    """
    if not targets.prices_spill or observation.spilled_per_s <= 0:
        return 0.0, 0.0
    assert targets.replica_cost_per_hour is not None
    assert targets.spill_cost_per_million_tokens is not None
    elapsed = now - state.last_tick if state.last_tick is not None else 0.0
    spend = state.spill_spend + (
        observation.spilled_tokens_per_s * elapsed * targets.spill_cost_per_million_tokens / 1e6
    )
    slots = observation.spilled_per_s * (observation.mean_service_s or 0.0)
    replicas = max(1, math.ceil(slots / targets.target_per_replica))
    commitment_h = (cold_start_s + targets.scale_down_delay_s) / 3600.0
    budget = replicas * targets.replica_cost_per_hour * commitment_h * targets.spill_patience
    return spend, budget


def _track_cold_starts(
    observation: Observation, now: float, state: PolicyState
) -> tuple[dict[str, float], float | None]:
    """Note when replicas are asked for, and time those that became ready since the last tick."""
    cold_start = state.cold_start_s
    starting_since: dict[str, float] = {}
    for replica in observation.replicas:
        since = state.starting_since.get(replica.name)
        if replica.state in (ReplicaState.STARTING, ReplicaState.PENDING):
            starting_since[replica.name] = since if since is not None else now
        elif replica.state is ReplicaState.READY and since is not None:
            measured = now - since
            cold_start = (
                measured
                if cold_start is None
                else COLD_START_SMOOTHING * measured + (1 - COLD_START_SMOOTHING) * cold_start
            )
    return starting_since, cold_start
