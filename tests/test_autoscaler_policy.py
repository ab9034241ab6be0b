"""The scaling rules of issue 5, one test per rule, on the pure policy with a fake clock."""

from __future__ import annotations

import pytest

from servefleet.autoscaler.policy import PolicyState, Reason, decide
from servefleet.autoscaler.signals import Observation, ReplicaLoad, ReplicaState
from servefleet.autoscaler.targets import ScalingTargets
from servefleet.autoscaler.victim import pick_victim, pod_deletion_costs

READY, STARTING, DRAINING = ReplicaState.READY, ReplicaState.STARTING, ReplicaState.DRAINING


def targets(**kw: float) -> ScalingTargets:
    base: dict = dict(
        min_replicas=1,
        max_replicas=5,
        target_per_replica=4,
        scale_down_delay_s=60,
        queue_wait_target_s=2,
        default_cold_start_s=30,
    )
    base.update(kw)
    return ScalingTargets(**base)


def pool(*states: ReplicaState, running: int = 0, queued: int = 0, **kw: float) -> Observation:
    replicas = tuple(
        ReplicaLoad(name=f"r{i}", state=s, running=running if s is READY else 0)
        for i, s in enumerate(states)
    )
    return Observation(gateway_queued=queued, replicas=replicas, **kw)


def test_desired_is_demand_over_target_rounded_up_and_clamped() -> None:
    d = decide(pool(READY, running=4, queued=5), targets(), now=0)
    assert (d.desired, d.reason) == (3, Reason.DEMAND)  # ceil(9 / 4)
    d = decide(pool(READY, running=4, queued=100), targets(), now=0)
    assert d.desired == 5  # maxReplicas


def test_never_below_the_warm_pool_even_when_idle() -> None:
    d = decide(pool(), targets(min_replicas=2), now=0)
    assert (d.desired, d.reason) == (2, Reason.BELOW_MIN)
    t, state = targets(min_replicas=2, scale_down_delay_s=0), None
    for now in range(0, 100, 10):
        d = decide(pool(READY, READY), t, now=now, state=state)
        state = d.state
        assert d.desired == 2


def test_starting_replicas_count_as_capacity_on_the_way() -> None:
    t = targets()
    first = decide(pool(READY, running=4, queued=4), t, now=0)
    assert first.desired == 2
    # Next tick: the new replica is still starting and the queue is unchanged.
    second = decide(pool(READY, STARTING, running=4, queued=4), t, now=5, state=first.state)
    assert (second.desired, second.reason) == (2, Reason.STEADY)


def test_scale_down_only_after_delay_and_one_step_at_a_time() -> None:
    t = targets(scale_down_delay_s=60)
    state = decide(pool(READY, READY, READY, running=4), t, now=0).state
    low = pool(READY, READY, READY, running=0)
    for now in (10, 30, 59):
        d = decide(low, t, now=now, state=state)
        state = d.state
        assert (d.desired, d.reason) == (3, Reason.SCALE_DOWN_DELAY)
    d = decide(low, t, now=75, state=state)
    assert (d.desired, d.reason) == (2, Reason.SCALE_DOWN)  # one step, not straight to 1
    # While the victim drains, no second step (the headroom over the falling level asked for
    # 2 until t=59, so the delay for the next step ends at 119).
    d2 = decide(pool(READY, READY, DRAINING), t, now=120, state=d.state)
    assert (d2.desired, d2.reason) == (2, Reason.WAITING_FOR_DRAIN)
    d3 = decide(pool(READY, READY), t, now=125, state=d2.state)
    assert (d3.desired, d3.reason) == (1, Reason.SCALE_DOWN)


def test_sustained_demand_inside_the_delay_restarts_it() -> None:
    t = targets(scale_down_delay_s=60)
    state = PolicyState()
    loads = {0: 0, 10: 0, 20: 8, 30: 8, 40: 8, 50: 8, 60: 0}  # needs both replicas for 40 s
    for now, running in loads.items():
        state = decide(pool(READY, READY, running=running // 2), t, now=now, state=state).state
    d = decide(pool(READY, READY), t, now=90, state=state)
    assert d.reason is Reason.SCALE_DOWN_DELAY  # demand needed both less than 60 s ago
    for now in range(100, 200, 10):
        d = decide(pool(READY, READY), t, now=now, state=d.state)
        if d.reason is Reason.SCALE_DOWN:
            break
    assert d.reason is Reason.SCALE_DOWN
    # The delay counted from when the burst ended (plus the minute its level and headroom take
    # to fall out of the window), not from the start.
    assert 110 <= now <= 180


def test_victim_is_fewest_in_flight_then_least_kv_cache() -> None:
    replicas = [
        ReplicaLoad(name="busy", state=READY, running=2, kv_cache_usage=0.1),
        ReplicaLoad(name="idle-hot", state=READY, running=1, kv_cache_usage=0.9),
        ReplicaLoad(name="idle-cold", state=READY, running=1, kv_cache_usage=0.2),
        ReplicaLoad(name="gone", state=DRAINING),
    ]
    assert pick_victim(replicas).name == "idle-cold"  # type: ignore[union-attr]
    costs = pod_deletion_costs(replicas)
    assert costs == {"idle-cold": 0, "idle-hot": 1, "busy": 2}
    t = targets(scale_down_delay_s=0)  # demand 4 (+2 headroom) fits 2 replicas of 4
    d = decide(Observation(replicas=tuple(replicas[:3])), t, now=0)
    assert (d.reason, d.victim) == (Reason.SCALE_DOWN, "idle-cold")


def test_scales_up_on_measured_queue_wait_even_when_depth_looks_fine() -> None:
    t = targets()
    d = decide(pool(READY, running=2, queue_wait_s=5.0), t, now=0)
    assert (d.desired, d.reason) == (2, Reason.LATENCY_OVER_TARGET)
    d = decide(pool(READY, running=2, ttft_s=3.0), targets(ttft_target_s=1.0), now=0)
    assert (d.desired, d.reason) == (2, Reason.LATENCY_OVER_TARGET)
    # ... but not again while the added replica is still starting.
    d = decide(pool(READY, STARTING, running=2, queue_wait_s=5.0), t, now=0)
    assert d.reason is not Reason.LATENCY_OVER_TARGET


def test_scale_to_zero_and_wake_up() -> None:
    t = targets(min_replicas=0, scale_down_delay_s=30)
    state = PolicyState()
    for now in (0, 20, 40):
        d = decide(pool(READY), t, now=now, state=state)
        state = d.state
    assert (d.desired, d.reason) == (0, Reason.SCALE_DOWN)
    wake = decide(pool(queued=3), t, now=50, state=state)
    assert (wake.desired, wake.reason) == (1, Reason.WAKE_FROM_ZERO)


def test_scales_ahead_of_a_queue_growing_faster_than_a_cold_start() -> None:
    t = targets(max_replicas=40, default_cold_start_s=60)
    state, d = PolicyState(), None
    for step in range(6):  # demand rising by 1 request/s, steady and clean
        d = decide(pool(READY, READY, READY, running=0, queued=10 + 5 * step), t, 5 * step, state)
        state = d.state
    assert d is not None
    assert d.reason is Reason.PREDICTED_GROWTH
    # Today's demand asks for ceil(35 / 4) = 9; in one cold start (60 s at +1/s) it is 95.
    assert d.desired == 24


def test_noise_in_a_flat_load_buys_nothing_ahead() -> None:
    t = targets(max_replicas=20, default_cold_start_s=60)
    state = PolicyState()
    for step, queued in enumerate([12, 9, 13, 10, 12, 8, 11, 13, 9, 12]):
        d = decide(pool(READY, READY, READY, queued=queued), t, 5 * step, state)
        state = d.state
        assert d.reason is not Reason.PREDICTED_GROWTH


def test_cold_start_is_measured_from_starting_to_ready() -> None:
    t = targets(default_cold_start_s=99)
    s = decide(pool(READY, STARTING), t, now=100).state
    s = decide(pool(READY, STARTING), t, now=110, state=s).state
    d = decide(pool(READY, READY), t, now=140, state=s)
    assert d.cold_start_s == pytest.approx(40)


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="minReplicas"):
        targets(min_replicas=4, max_replicas=2)


def test_stale_latency_without_demand_does_not_hold_the_pool_up() -> None:
    """The gateway's p90s cover the last minute; once the burst is over they must not scale."""
    t = targets(scale_down_delay_s=10)
    idle_but_slow = dict(queue_wait_s=9.0, ttft_s=9.0)
    d = decide(pool(READY, READY, **idle_but_slow), t, now=0)
    assert d.desired == 2 and d.reason is not Reason.LATENCY_OVER_TARGET
    d = decide(pool(READY, READY, **idle_but_slow), t, now=20, state=d.state)
    assert (d.desired, d.reason) == (1, Reason.SCALE_DOWN)
