"""Sweep every policy's settings over a trace: SLO attainment against cost, and who dominates.

Cost is in replica-hours, with spilled tokens converted at the given prices (hosted-API price
per million tokens over the price of a replica-hour), so one axis carries both. A policy's
frontier is its points that no other of its points beats on both axes; ours dominates another
when every point of theirs is matched by one of ours at no more cost and no less SLO.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from servefleet.autoscaler.targets import ScalingTargets

from .sim_cluster import ClusterSpec, ScalingPolicy, SimResult, simulate
from .sim_policies import FixedPolicy, HpaPolicy, KedaPolicy, KubeAiPolicy, ServefleetPolicy
from .sim_trace import Trace

POLICIES = ("servefleet", "hpa", "keda", "kubeai", "fixed")
PRACTICAL_SLO_TOLERANCE = 1e-4
"""0.01 percentage points: a few requests in a day's trace. "Practically dominates" also leaves
out their points under 50 % SLO (an HPA that never scales is cheap, but serves nobody)."""


class Prices(BaseModel):
    model_config = ConfigDict(frozen=True)

    replica_hour: float = Field(default=2.0, gt=0, description="price of one replica-hour")
    spill_per_million_tokens: float = Field(default=2.0, gt=0, description="hosted API price")


class SweepSpec(BaseModel):
    """The pool every policy runs (same bounds, interval, delay) and the settings swept."""

    model_config = ConfigDict(frozen=True)

    cluster: ClusterSpec
    prices: Prices = Field(default_factory=Prices)
    min_replicas: int = 1
    max_replicas: int = 24
    scale_down_delay_s: float = 300.0
    slo_wait_s: float = 2.0
    utilisations: tuple[float, ...] = Field(
        default=(0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0, 1.25, 1.5),
        description="target per replica / slots; above 1 leans on queue and spill-over",
    )
    delays_s: tuple[float, ...] = (120.0, 300.0)
    kubeai_windows_s: tuple[float, ...] = (60.0, 600.0)
    fixed_sizes: tuple[int, ...] = (4, 8, 12, 16, 20, 24)
    baseline_spill: bool = Field(
        default=False,
        description="the other policies also run behind a spilling gateway (by default only "
        "ours spills: HPA, KEDA, KubeAI and a fixed pool have no spill-over of their own)",
    )
    warm_minimums: tuple[int, ...] = Field(
        default=(), description="also sweep our warm pool (which minimum meets the SLO?)"
    )
    spill_patiences: tuple[float, ...] = Field(
        default=(4.0, 1000.0),
        description="our spill-heavy settings: a warm pool of each fixed size (and each warm "
        "minimum) that spills this many times longer than rent-or-buy before buying",
    )
    grid_patiences: tuple[float, ...] = Field(
        default=(1.0, 0.25, 0.05),
        description="the target/delay grid at each of these spill patiences: below 1 buys "
        "sooner than rent-or-buy, so the pool spends less time full while renting",
    )
    warm_floors: tuple[int, ...] = Field(
        default=(2, 3, 4, 5, 6, 7, 8),
        description="ours with a warm floor (minReplicas) under target 1.0 × slots, delay "
        "120 s, at each grid patience: the floor takes the start and the spells a pool at its "
        "target would spend full",
    )
    pinned_pools: tuple[int, ...] = Field(
        default=(1, 2, 4),
        description="ours pinned at minReplicas = maxReplicas = N with spill-over off: the "
        "cheap corner that only a fixed pool reaches (scaling from fewer costs it SLO)",
    )


class Point(BaseModel):
    """One run: which policy with which settings on which trace, and what it cost."""

    model_config = ConfigDict(frozen=True)

    trace: str
    policy: str
    settings: dict[str, float]
    slo_attainment: float
    replica_hours: float
    spilled_requests: int
    spilled_tokens: int
    cost: float = Field(description="replica-hours + spilled tokens priced as replica-hours")
    p99_wait_s: float
    batch_p99_wait_s: float


def settings_for(policy: str, sweep: SweepSpec) -> list[dict[str, float]]:
    slots = sweep.cluster.concurrency
    if policy == "servefleet":
        return _servefleet_settings(sweep)
    if policy == "hpa":  # a utilisation cannot be over 100 %
        return [{"utilisation": u} for u in sweep.utilisations if u <= 1.0]
    if policy == "keda":
        return [{"utilisation": u} for u in sweep.utilisations]
    if policy == "kubeai":
        return [
            {"utilisation": u, "window_s": w}
            for u in sweep.utilisations[::2]
            for w in sweep.kubeai_windows_s
        ]
    return [{"replicas": float(n)} for n in sweep.fixed_sizes if n <= sweep.max_replicas] or [
        {"replicas": float(slots)}
    ]


def _patience(p: float) -> dict[str, float]:
    """The spill-patience setting, left out at its default (1: rent-or-buy)."""
    return {} if p == 1 else {"spill_patience": p}


def _servefleet_settings(sweep: SweepSpec) -> list[dict[str, float]]:
    """The target/delay grid (at each grid patience), plus spill-heavy warm pools: where bursts
    are shorter than a cold start, a pool kept at its minimum that leaves bursts to the hosted
    API is the cheap end. Warm floors under the grid's target 1.0 fill the high-SLO end; pinned
    pools without spill-over (`spill` 0) are the corner below everything."""
    base = [
        {"utilisation": u, "delay_s": d} | _patience(p)
        for p in sweep.grid_patiences
        for u in sweep.utilisations
        for d in sweep.delays_s
    ]
    grid = [{**b, "min_replicas": float(m)} for b in base for m in sweep.warm_minimums] or base
    pools = sorted({*sweep.fixed_sizes, *sweep.warm_minimums})
    spill_heavy = [
        {
            "utilisation": max(sweep.utilisations),
            "delay_s": min(sweep.delays_s),
            "min_replicas": float(m),
            "spill_patience": p,
        }
        for m in pools
        if sweep.min_replicas <= m <= sweep.max_replicas
        for p in sweep.spill_patiences
    ]
    floors = [
        {"utilisation": 1.0, "delay_s": min(sweep.delays_s), "min_replicas": float(m)}
        | _patience(p)
        for m in sweep.warm_floors
        if sweep.min_replicas < m <= sweep.max_replicas
        for p in sweep.grid_patiences
    ]
    pinned = [
        {
            "utilisation": 1.0,
            "delay_s": max(sweep.delays_s),
            "min_replicas": float(n),
            "max_replicas": float(n),
            "spill": 0.0,
        }
        for n in sweep.pinned_pools
        if sweep.min_replicas <= n <= sweep.max_replicas
    ]
    every = grid + spill_heavy + floors + pinned
    return [s for i, s in enumerate(every) if s not in every[:i]]  # a floor may be a minimum


def build_policy(policy: str, settings: dict[str, float], sweep: SweepSpec) -> ScalingPolicy:
    slots, lo, hi = sweep.cluster.concurrency, sweep.min_replicas, sweep.max_replicas
    per_replica = settings.get("utilisation", 0.75) * slots
    if policy == "servefleet":
        return ServefleetPolicy(
            targets=ScalingTargets(
                min_replicas=int(settings.get("min_replicas", lo)),
                max_replicas=int(settings.get("max_replicas", hi)),
                target_per_replica=per_replica,
                scale_down_delay_s=settings["delay_s"],
                queue_wait_target_s=sweep.slo_wait_s,
                default_cold_start_s=sweep.cluster.cold_start_s,
                replica_cost_per_hour=sweep.prices.replica_hour,
                spill_cost_per_million_tokens=sweep.prices.spill_per_million_tokens,
                spill_patience=settings.get("spill_patience", 1.0),
            )
        )
    if policy == "hpa":
        return HpaPolicy(settings["utilisation"], max(1, lo), hi, sweep.scale_down_delay_s)
    if policy == "keda":
        return KedaPolicy(per_replica, lo, hi, sweep.scale_down_delay_s)
    if policy == "kubeai":
        return KubeAiPolicy(per_replica, lo, hi, settings["window_s"], sweep.scale_down_delay_s)
    return FixedPolicy(replicas=int(settings["replicas"]))


def run_point(trace: Trace, policy: str, settings: dict[str, float], sweep: SweepSpec) -> Point:
    cluster = sweep.cluster
    if (policy != "servefleet" and not sweep.baseline_spill) or settings.get("spill") == 0:
        cluster = cluster.model_copy(
            update={"spill": cluster.spill.model_copy(update={"enabled": False})}
        )
    # A pool starts warm at its own minimum, as a fixed pool starts at its size.
    warm = settings.get("replicas", settings.get("min_replicas"))
    if warm is not None:
        cluster = cluster.model_copy(update={"initial_replicas": int(warm)})
    result = simulate(trace, cluster, build_policy(policy, settings, sweep))
    return point_of(trace.name, policy, settings, result, sweep)


def point_of(
    trace: str, policy: str, settings: dict[str, float], result: SimResult, sweep: SweepSpec
) -> Point:
    prices = sweep.prices
    spill_cost = result.spilled_tokens / 1e6 * prices.spill_per_million_tokens / prices.replica_hour
    return Point(
        trace=trace,
        policy=policy,
        settings=settings,
        slo_attainment=round(result.slo_attainment(sweep.slo_wait_s), 5),
        replica_hours=round(result.replica_hours, 3),
        spilled_requests=result.spilled,
        spilled_tokens=result.spilled_tokens,
        cost=round(result.replica_hours + spill_cost, 3),
        p99_wait_s=round(_quantile(result.waits_s, 0.99), 3),
        batch_p99_wait_s=round(_quantile(result.batch_waits_s, 0.99), 3),
    )


def sweep_trace(
    trace: Trace, sweep: SweepSpec, policies: Sequence[str] = POLICIES, jobs: int = 1
) -> list[Point]:
    """Every (policy, settings) on `trace`; `jobs` processes share the runs."""
    runs = [(p, s) for p in policies for s in settings_for(p, sweep)]
    if jobs <= 1:
        return [run_point(trace, p, s, sweep) for p, s in runs]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_point, trace, p, s, sweep) for p, s in runs]
        return [f.result() for f in futures]


def frontier(points: Sequence[Point]) -> list[Point]:
    """Points no other point beats on both cost and SLO, cheapest first."""
    best: list[Point] = []
    for p in sorted(points, key=lambda p: (p.cost, -p.slo_attainment)):
        if not best or p.slo_attainment > best[-1].slo_attainment:
            best.append(p)
    return best


def unmatched(
    ours: Sequence[Point], theirs: Sequence[Point], slo_tolerance: float = 0.0
) -> list[Point]:
    """Their frontier points that none of ours matches at no more cost and no less SLO
    (less `slo_tolerance`, for a "practically dominates" that ignores a handful of requests)."""
    return [
        t
        for t in frontier(theirs)
        if not any(
            o.cost <= t.cost and o.slo_attainment >= t.slo_attainment - slo_tolerance for o in ours
        )
    ]


def dominates(ours: Sequence[Point], theirs: Sequence[Point]) -> bool:
    """Each of their frontier points is matched by one of ours: no more cost, no less SLO."""
    return not unmatched(ours, theirs)


def verdict(points: Sequence[Point], goal_slo: float = 0.99) -> dict[str, Any]:
    """Dominance per policy and the goal: ≥ `goal_slo` at ≤ half the full fixed pool's cost."""
    by_policy: dict[str, list[Point]] = {}
    for p in points:
        by_policy.setdefault(p.policy, []).append(p)
    ours = by_policy.get("servefleet", [])
    fixed = by_policy.get("fixed", [])
    full = max(fixed, key=lambda p: p.settings["replicas"]) if fixed else None
    cheapest_fixed = min(
        (p for p in fixed if p.slo_attainment >= goal_slo), key=lambda p: p.cost, default=None
    )
    meeting = [p for p in ours if p.slo_attainment >= goal_slo]
    best = min(meeting, key=lambda p: p.cost) if meeting else None
    others = {name: pts for name, pts in by_policy.items() if pts is not ours}
    missed = {name: unmatched(ours, pts) for name, pts in others.items()}
    return {
        "dominates": {name: not points for name, points in missed.items()},  # as `dominates`
        "unmatched": {
            name: [(p.cost, p.slo_attainment) for p in points] for name, points in missed.items()
        },
        "dominates_practically": {
            name: not [
                t for t in unmatched(ours, pts, PRACTICAL_SLO_TOLERANCE) if t.slo_attainment >= 0.5
            ]
            for name, pts in others.items()
        },
        "goal_slo": goal_slo,
        "fixed_pool_cost": full.cost if full else None,
        "cheapest_fixed_meeting_goal": cheapest_fixed.model_dump() if cheapest_fixed else None,
        "ours_cheapest_meeting_goal": best.model_dump() if best else None,
        "cost_share_of_fixed_pool": (
            round(best.cost / full.cost, 3) if best and full and full.cost else None
        ),
        "goal_met": bool(best and full and best.cost <= 0.5 * full.cost),
        "best_slo_ours": max((p.slo_attainment for p in ours), default=math.nan),
    }


def _quantile(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else 0.0
