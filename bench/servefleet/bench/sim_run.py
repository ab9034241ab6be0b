"""What `bench/autoscaler_sim.py` and `servefleet sim` share: options, sweep, output.

Both sweep every policy's settings over traces and write one JSON and one PNG; only where
the traces come from differs (synthetic ones, or a gateway access log).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from .sim_cluster import ClusterSpec, SpillSpec
from .sim_frontier import POLICIES, Prices, SweepSpec, sweep_trace, verdict
from .sim_report import frontier_table, write_report
from .sim_trace import Trace


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """The pool and prices every policy shares (also `servefleet sim`)."""
    p.add_argument("--concurrency", type=int, default=8, help="slots per replica")
    p.add_argument("--cold-start", type=float, default=60.0, help="seconds until a replica serves")
    p.add_argument("--interval", type=float, default=10.0, help="autoscaler tick, every policy")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=24)
    p.add_argument("--scale-down-delay", type=float, default=300.0, help="also the HPA window")
    p.add_argument("--queue-wait-target", type=float, default=2.0, help="SLO on queue wait (s)")
    p.add_argument("--replica-hour-price", type=float, default=2.0)
    p.add_argument("--spill-price", type=float, default=2.0, help="hosted API, per 1M tokens")
    p.add_argument("--no-spill", action="store_true", help="the gateway never spills over")
    p.add_argument(
        "--baseline-spill",
        action="store_true",
        help="the other policies spill over too (default: only ours has spill-over)",
    )
    p.add_argument(
        "--spill-wait",
        type=float,
        default=None,
        help="predicted queue wait (s) over which the gateway spills; default half the SLO",
    )
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--jobs", type=int, default=2, help="processes running the sweep")
    p.add_argument("--warm-minimums", default="", help="also sweep our minReplicas, e.g. 0,1,2,4")
    p.add_argument(
        "--spill-patiences",
        default="4,1000",
        help="our spill-heavy settings: warm pools that spill this many times longer than "
        "rent-or-buy (empty: none)",
    )
    p.add_argument(
        "--grid-patiences",
        default="1,0.25,0.05",
        help="our target/delay grid at each of these spill patiences (below 1 buys sooner)",
    )
    p.add_argument(
        "--warm-floors",
        default="2,3,4,5,6,7,8",
        help="ours with these minReplicas under target 1.0 x slots, delay 120 s (empty: none)",
    )
    p.add_argument(
        "--pinned-pools",
        default="1,2,4",
        help="ours pinned at minReplicas = maxReplicas = N without spill-over (empty: none)",
    )


def sweep_from_args(args: argparse.Namespace) -> SweepSpec:
    cluster = ClusterSpec(
        concurrency=args.concurrency,
        cold_start_s=args.cold_start,
        initial_replicas=args.min_replicas,
        tick_s=args.interval,
        spill=SpillSpec(
            enabled=not args.no_spill,
            # A prediction is a mean: spilling at half the target keeps the tail under it.
            wait_threshold_s=args.spill_wait or args.queue_wait_target / 2,
        ),
    )
    return SweepSpec(
        cluster=cluster,
        prices=Prices(
            replica_hour=args.replica_hour_price, spill_per_million_tokens=args.spill_price
        ),
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        scale_down_delay_s=args.scale_down_delay,
        slo_wait_s=args.queue_wait_target,
        baseline_spill=args.baseline_spill,
        warm_minimums=tuple(int(m) for m in args.warm_minimums.split(",") if m),
        spill_patiences=tuple(float(p) for p in args.spill_patiences.split(",") if p),
        grid_patiences=tuple(float(p) for p in args.grid_patiences.split(",") if p),
        warm_floors=tuple(int(m) for m in args.warm_floors.split(",") if m),
        pinned_pools=tuple(int(n) for n in args.pinned_pools.split(",") if n),
        fixed_sizes=tuple(
            sorted({*range(2, 9, 2), *range(12, args.max_replicas + 1, 4), args.max_replicas})
        ),
    )


def describe(trace: Trace) -> dict[str, object]:
    return {
        "requests": int(trace.arrivals_s.size),
        "hours": round(trace.duration_s / 3600, 2),
        "arrival_cv": round(trace.arrival_cv(), 2),
        "batch_share": round(float(trace.batch.mean()), 3) if trace.batch.size else 0.0,
        "mean_service_s": round(trace.mean_service_s, 2),
        "p99_tokens": int(np.quantile(trace.tokens, 0.99)),
    }


def run(traces: list[Trace], args: argparse.Namespace, out: Path, stem: str) -> dict[str, object]:
    """Sweep every trace, print the table and verdicts, write the JSON and PNG."""
    sweep = sweep_from_args(args)
    policies = [p for p in args.policies.split(",") if p]
    started = time.monotonic()
    points = {t.name: sweep_trace(t, sweep, policies, jobs=args.jobs) for t in traces}
    for pts in points.values():
        print(frontier_table(pts))
    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    params["sweep"] = sweep.model_dump()
    summary = {name: verdict(pts) for name, pts in points.items()}
    report = write_report(points, {t.name: describe(t) for t in traces}, summary, params, out, stem)
    print(json.dumps({"seconds": round(time.monotonic() - started, 1), "verdicts": summary}))
    return report
