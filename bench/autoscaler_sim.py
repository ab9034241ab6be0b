"""Trace-driven autoscaler simulator: our policy vs a fixed pool vs HPA-style utilisation.

    uv run python bench/autoscaler_sim.py [--seed 7] [--out bench/results/autoscaler_sim]

Replays the real `servefleet.autoscaler.policy.decide` on a simulated clock. Prints a table
and one JSON summary; writes `<out>/autoscaler_sim.json` and `<out>/autoscaler_sim.png`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from servefleet.autoscaler.targets import ScalingTargets
from servefleet.bench.sim_cluster import ClusterSpec, ScalingPolicy, simulate
from servefleet.bench.sim_policies import FixedPolicy, HpaPolicy, ServefleetPolicy
from servefleet.bench.sim_report import plot_timeline, summary, table
from servefleet.bench.sim_trace import TraceSpec, make_trace


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--hours", type=float, default=6.0, help="simulated length of one 'day'")
    p.add_argument("--peak-rate", type=float, default=8.0, help="requests/s at the diurnal peak")
    p.add_argument("--spikes", type=int, default=8)
    p.add_argument("--mean-service", type=float, default=6.0, help="seconds a request holds a slot")
    p.add_argument("--concurrency", type=int, default=8, help="slots per replica")
    p.add_argument("--cold-start", type=float, default=60.0, help="seconds until a replica serves")
    p.add_argument("--interval", type=float, default=10.0, help="autoscaler tick, both policies")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=24)
    p.add_argument("--scale-down-delay", type=float, default=300.0, help="also the HPA window")
    p.add_argument(
        "--target-utilisation",
        type=float,
        default=0.75,
        help="HPA target; ours targets the same share of slots per replica",
    )
    p.add_argument("--queue-wait-target", type=float, default=2.0, help="SLO on queue wait (s)")
    p.add_argument("--fixed-replicas", type=int, default=None, help="default: max replicas")
    p.add_argument("--out", type=Path, default=Path("bench/results/autoscaler_sim"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    trace = make_trace(
        TraceSpec(
            duration_s=args.hours * 3600,
            peak_rate=args.peak_rate,
            spikes=args.spikes,
            mean_service_s=args.mean_service,
            seed=args.seed,
        )
    )
    cluster = ClusterSpec(
        concurrency=args.concurrency,
        cold_start_s=args.cold_start,
        initial_replicas=args.min_replicas,
        tick_s=args.interval,
    )
    targets = ScalingTargets(
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_per_replica=args.target_utilisation * args.concurrency,
        scale_down_delay_s=args.scale_down_delay,
        queue_wait_target_s=args.queue_wait_target,
        default_cold_start_s=args.cold_start,
    )
    policies: list[ScalingPolicy] = [
        ServefleetPolicy(targets=targets),
        HpaPolicy(
            target_utilisation=args.target_utilisation,
            min_replicas=max(1, args.min_replicas),
            max_replicas=args.max_replicas,
            stabilisation_s=args.scale_down_delay,
        ),
        FixedPolicy(replicas=args.fixed_replicas or args.max_replicas),
    ]
    results = [simulate(trace, cluster, policy) for policy in policies]
    rows = summary(results, args.queue_wait_target)
    print(table(rows))
    ours, hpa = rows["servefleet"], rows["hpa"]
    verdict = {
        "beats_hpa_on_slo": ours["slo_attainment"] > hpa["slo_attainment"],
        "replica_hours_vs_hpa": round(ours["replica_hours"] / hpa["replica_hours"], 3),
    }
    report = {
        "benchmark": "autoscaler_sim",
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "requests": int(trace.arrivals_s.size),
        "results": rows,
        "decisions_by_reason": results[0].reasons,
        **verdict,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "autoscaler_sim.json").write_text(json.dumps(report, indent=2))
    plot_timeline(trace, results, args.out / "autoscaler_sim.png")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
