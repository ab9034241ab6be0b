"""The simulator replays the real policy; checked on a short trace so the suite stays fast."""

from __future__ import annotations

import numpy as np

from servefleet.autoscaler.targets import ScalingTargets
from servefleet.bench.sim_cluster import ClusterSpec, simulate
from servefleet.bench.sim_policies import FixedPolicy, HpaPolicy, ServefleetPolicy
from servefleet.bench.sim_trace import Trace, TraceSpec, make_trace, rate_at


def _trace() -> Trace:
    return make_trace(TraceSpec(duration_s=1800, peak_rate=4, spikes=2, seed=3))


def test_trace_is_seeded_and_follows_the_curve() -> None:
    a, b = _trace(), _trace()
    assert np.array_equal(a.arrivals_s, b.arrivals_s)
    expected = sum(rate_at(a.spec, a.spikes, s + 0.5) for s in range(1800))
    assert abs(a.arrivals_s.size - expected) < 4 * expected**0.5


def test_every_request_is_served_and_accounted() -> None:
    trace = _trace()
    cluster = ClusterSpec(concurrency=8, cold_start_s=30, tick_s=5)
    targets = ScalingTargets(
        min_replicas=1,
        max_replicas=8,
        target_per_replica=6,
        scale_down_delay_s=120,
        queue_wait_target_s=2,
    )
    ours = simulate(trace, cluster, ServefleetPolicy(targets=targets))
    fixed = simulate(trace, cluster, FixedPolicy(replicas=8))
    hpa = simulate(trace, cluster, HpaPolicy(0.75, 1, 8, 120))
    for result in (ours, fixed, hpa):
        assert result.waits_s.size == trace.arrivals_s.size
        assert (result.waits_s >= 0).all()
    # A fixed pool at the maximum never makes anyone wait long and costs the most.
    assert fixed.slo_attainment(2.0) > 0.99
    assert fixed.replica_hours > ours.replica_hours
    assert abs(fixed.replica_hours - 8 * 1800 / 3600) < 0.05
    # The policy really ran: it scaled, and said why.
    assert max(ours.timeline_replicas) > 1
    assert {"demand", "scale_down"} <= set(ours.reasons)
