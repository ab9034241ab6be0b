"""The simulator replays the real policy; checked on short traces and tiny sweeps so the suite
stays fast."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from servefleet.api.access_log import AccessLogLine
from servefleet.autoscaler.targets import ScalingTargets
from servefleet.bench.sim_access_log import read_access_log, write_access_log
from servefleet.bench.sim_bursty import BurstySpec, make_bursty_trace
from servefleet.bench.sim_cluster import ClusterSpec, SpillSpec, simulate
from servefleet.bench.sim_frontier import Point, SweepSpec, dominates, frontier, run_point, verdict
from servefleet.bench.sim_policies import FixedPolicy, HpaPolicy, ServefleetPolicy
from servefleet.bench.sim_trace import Trace, TraceSpec, make_trace, rate_at
from servefleet.cli.main import main as cli_main


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


def _steady(rate: float, seconds: float = 3 * 3600, seed: int = 5) -> Trace:
    spec = TraceSpec(duration_s=seconds, peak_rate=rate, trough_share=1.0, spikes=0, seed=seed)
    return make_trace(spec)


def _changes(sizes: list[int]) -> list[str]:
    return ["up" if b > a else "down" for a, b in pairwise(sizes) if a != b]


def _targets(**kw: float) -> ScalingTargets:
    base: dict = dict(min_replicas=1, max_replicas=24, target_per_replica=6, scale_down_delay_s=300)
    base.update(kw)
    return ScalingTargets(queue_wait_target_s=2, default_cold_start_s=60, **base)


def test_a_steady_load_never_goes_up_down_up_in_the_simulator() -> None:
    cluster = ClusterSpec(concurrency=8, cold_start_s=60, tick_s=10)
    for rate in (0.7, 2.0, 4.1, 7.5):
        result = simulate(_steady(rate), cluster, ServefleetPolicy(targets=_targets()))
        changes = _changes(result.timeline_replicas)
        assert "up" not in changes[changes.index("down") :] if "down" in changes else True, (
            rate,
            changes,
        )


def test_a_burst_jumps_and_idle_returns_to_the_warm_pool_in_the_simulator() -> None:
    quiet = _steady(0.2, seconds=1200)
    burst_at = 300.0
    extra = np.sort(burst_at + np.random.default_rng(1).uniform(0, 20, size=300))
    arrivals = np.concatenate([quiet.arrivals_s, extra])
    order = np.argsort(arrivals, kind="stable")
    service = np.concatenate([quiet.service_s, np.full(extra.size, 6.0)])[order]
    trace = quiet.model_copy(
        update={
            "arrivals_s": arrivals[order],
            "service_s": service,
            "tokens": np.full(arrivals.size, 500),
            "batch": np.zeros(arrivals.size, dtype=bool),
        }
    )
    cluster = ClusterSpec(concurrency=8, cold_start_s=30, tick_s=10)
    result = simulate(trace, cluster, ServefleetPolicy(targets=_targets(scale_down_delay_s=120)))
    steps = np.diff(result.timeline_replicas)
    assert steps.max() >= 5  # one tick, not one replica per tick
    assert result.timeline_replicas[-1] == 1  # back to the warm pool once it is over


def _with_batch_dump(quiet: Trace, size: int, at_s: float) -> Trace:
    arrivals = np.concatenate([quiet.arrivals_s, np.full(size, at_s)])
    order = np.argsort(arrivals, kind="stable")
    batch = np.concatenate([np.zeros(quiet.arrivals_s.size, bool), np.ones(size, bool)])
    return quiet.model_copy(
        update={
            "arrivals_s": arrivals[order],
            "service_s": np.concatenate([quiet.service_s, np.full(size, 6.0)])[order],
            "tokens": np.full(arrivals.size, 500),
            "batch": batch[order],
        }
    )


def test_a_batch_backlog_waits_and_buys_no_replica_in_the_simulator() -> None:
    """400 batch requests dumped at once drain through the warm pool (waits of minutes) and
    buy nothing, queued or running; the same 400 as interactive requests fill the pool."""
    cluster = ClusterSpec(concurrency=8, cold_start_s=30, tick_s=10, spill=SpillSpec(enabled=True))
    priced = _targets(replica_cost_per_hour=2.0, spill_cost_per_million_tokens=2.0)
    alone = _with_batch_dump(_steady(0.3, seconds=1800), 400, 120.0)
    alone = alone.model_copy(update={"batch": np.ones(alone.arrivals_s.size, bool)})
    for targets in (_targets(), priced):
        result = simulate(alone, cluster, ServefleetPolicy(targets=targets))
        assert max(result.timeline_replicas) == 1, result.reasons
        assert result.batch_waits_s.max() > 60 and result.spilled == 0
    # Beside light interactive traffic, only interactive latency may add a replica (its
    # requests wait for slots the batch holds), one at a time, never the backlog's size.
    mixed = _with_batch_dump(_steady(0.3, seconds=1800), 400, 120.0)
    result = simulate(mixed, cluster, ServefleetPolicy(targets=_targets()))
    assert max(result.timeline_replicas) <= 2
    assert not {"demand", "predicted_growth", "spill_costs_more"} & set(result.reasons)
    rush = mixed.model_copy(update={"batch": np.zeros(mixed.arrivals_s.size, bool)})
    result = simulate(rush, cluster, ServefleetPolicy(targets=_targets()))
    assert max(result.timeline_replicas) > 10


def test_spill_over_takes_interactive_only_and_is_billed_by_tokens() -> None:
    trace = make_trace(TraceSpec(duration_s=600, peak_rate=6, spikes=0, batch_share=0.3, seed=2))
    cluster = ClusterSpec(concurrency=4, cold_start_s=30, tick_s=5, spill=SpillSpec(enabled=True))
    result = simulate(trace, cluster, FixedPolicy(replicas=1))
    assert result.spilled > 0
    assert result.spilled_tokens > 100 * result.spilled
    assert result.waits_s.size + result.batch_waits_s.size == trace.arrivals_s.size
    assert result.batch_waits_s.size == int(trace.batch.sum())  # batch waits, never spills
    assert np.quantile(result.waits_s, 0.9) <= 2.0  # the gateway kept interactive waits short


def test_bursty_trace_is_bursty_heavy_tailed_and_seeded() -> None:
    spec = BurstySpec(duration_s=3600, seed=3)
    a, b = make_bursty_trace(spec), make_bursty_trace(spec)
    assert np.array_equal(a.arrivals_s, b.arrivals_s)
    assert a.arrival_cv() > 2.0
    assert np.quantile(a.tokens, 0.99) > 5 * np.median(a.tokens)
    assert 0.1 < a.batch.mean() < 0.2


def test_access_log_replays_what_was_written(tmp_path: Path) -> None:
    trace = make_trace(TraceSpec(duration_s=600, peak_rate=2, spikes=1, batch_share=0.2, seed=4))
    log = tmp_path / "access.jsonl"
    write_access_log(trace, log)
    first = AccessLogLine.model_validate_json(log.read_text().splitlines()[0])
    assert first.deployment and first.prompt_tokens + first.completion_tokens > 0
    replayed = read_access_log(log)
    assert np.allclose(replayed.arrivals_s, trace.arrivals_s - trace.arrivals_s[0])
    assert np.allclose(replayed.service_s, trace.service_s)
    assert np.array_equal(replayed.tokens, trace.tokens)
    assert np.array_equal(replayed.batch, trace.batch)
    log.write_text(log.read_text() + "{not json}\n")
    with pytest.raises(ValueError, match=f"line {trace.arrivals_s.size + 1}"):
        read_access_log(log)


def test_frontier_and_dominance() -> None:
    def pt(policy: str, cost: float, slo: float) -> Point:
        settings = {"replicas": cost} if policy == "fixed" else {}
        return Point(
            trace="t",
            policy=policy,
            settings=settings,
            slo_attainment=slo,
            replica_hours=cost,
            spilled_requests=0,
            spilled_tokens=0,
            cost=cost,
            p99_wait_s=0,
            batch_p99_wait_s=0,
        )

    ours = [pt("servefleet", 5, 0.95), pt("servefleet", 6, 0.99), pt("servefleet", 7, 0.98)]
    assert [p.cost for p in frontier(ours)] == [5, 6]
    assert dominates(ours, [pt("hpa", 5, 0.94), pt("hpa", 8, 0.99)])
    assert not dominates(ours, [pt("hpa", 4, 0.90)])  # cheaper than anything of ours
    fixed = [pt("fixed", 20, 1.0), pt("fixed", 10, 0.995)]
    v = verdict([*ours, *fixed])
    assert v["goal_met"] and v["cost_share_of_fixed_pool"] == 0.3
    assert v["cheapest_fixed_meeting_goal"]["cost"] == 10


def test_sim_command_sweeps_an_access_log(tmp_path: Path) -> None:
    trace = make_trace(TraceSpec(duration_s=900, peak_rate=3, spikes=1, seed=6))
    log = tmp_path / "access.jsonl"
    write_access_log(trace, log)
    out = tmp_path / "out"
    argv = ["sim", "--trace", str(log), "--out", str(out), "--jobs", "1", "--max-replicas", "6"]
    sweep = ["--policies", "servefleet,fixed", "--warm-minimums", "0,1", "--spill-patiences", "50"]
    sweep += ["--grid-patiences", "1,0.25", "--warm-floors", "3"]
    assert cli_main([*argv, *sweep]) == 0
    report = json.loads((out / "sim.json").read_text())
    (name,) = report["traces"]
    points = report["traces"][name]["points"]
    assert {p["policy"] for p in points} == {"servefleet", "fixed"}
    ours = [p["settings"] for p in points if p["policy"] == "servefleet"]
    grid = [s for s in ours if s.get("spill_patience", 1) < 50 and "spill" not in s]
    floors_and_grid = {(m, p) for m in (0.0, 1.0, 3.0) for p in (1, 0.25)}  # 3: the floor
    assert {(s["min_replicas"], s.get("spill_patience", 1)) for s in grid} == floors_and_grid
    assert {s["utilisation"] for s in grid if s["min_replicas"] == 3} == {1.0}
    # ... and the spill-heavy warm pools, one per fixed size (and warm minimum above the floor).
    assert {s["min_replicas"] for s in ours if s.get("spill_patience") == 50} == {1, 2, 4, 6}
    # ... and pools pinned at min = max without spill-over: the cheap corner.
    pinned = {int(s["max_replicas"]) for s in ours if s.get("spill") == 0}
    assert pinned == {1, 2, 4} and all(
        s["min_replicas"] == s["max_replicas"] for s in ours if s.get("spill") == 0
    )
    assert (out / "sim.png").stat().st_size > 0
    # Every point is reproducible: the same settings give the same numbers.
    again = run_point(read_access_log(log), "fixed", {"replicas": 2.0}, _sweep_of(report))
    first = next(p for p in points if p["policy"] == "fixed" and p["settings"]["replicas"] == 2)
    assert again.model_dump() == {**first, "trace": again.trace}
    # Ours pinned at 2 without spill-over is that fixed pool: the same run, the same numbers.
    two = next(p for p in points if p["settings"].get("spill") == 0 and p["cost"] == first["cost"])
    assert (two["settings"]["max_replicas"], two["slo_attainment"]) == (2, first["slo_attainment"])


def _sweep_of(report: dict) -> SweepSpec:
    return SweepSpec.model_validate(report["params"]["sweep"])
