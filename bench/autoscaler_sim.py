"""Autoscaler simulator: each policy's SLO/cost frontier on three traces.

    uv run python bench/autoscaler_sim.py [--seed 7] [--jobs 2] [--trace ACCESS_LOG]
        [--replica-hour-price 2] [--spill-price 2] [--out bench/results/autoscaler_sim]

Replays the real `servefleet.autoscaler.policy.decide` on a simulated clock next to HPA-style
utilisation, KEDA-style queue length, KubeAI-style in-flight average and fixed pools, sweeping
each one's settings, behind the same gateway (spill-over on unless `--no-spill`). Traces: the
diurnal curve with spikes, a bursty one (arrival CV > 1, heavy-tailed lengths), and a gateway
access log (`--trace FILE`; by default a seeded one written next to the results). Prints a
table and the verdicts; writes `<out>/autoscaler_sim.json` and `<out>/autoscaler_sim.png`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servefleet.bench.sim_access_log import office_week_log, read_access_log
from servefleet.bench.sim_bursty import BurstySpec, make_bursty_trace
from servefleet.bench.sim_run import add_sweep_arguments, run
from servefleet.bench.sim_trace import TraceSpec, make_trace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=7, help="diurnal trace; bursty uses seed + 4")
    p.add_argument("--hours", type=float, default=6.0, help="simulated length of each trace")
    p.add_argument("--peak-rate", type=float, default=8.0, help="requests/s at the diurnal peak")
    p.add_argument("--trace", type=Path, default=None, help="a gateway access log to replay")
    p.add_argument("--out", type=Path, default=Path("bench/results/autoscaler_sim"))
    add_sweep_arguments(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    hours = args.hours * 3600
    log = args.trace or office_week_log(args.out / "office_week.access.jsonl", hours=args.hours)
    traces = [
        make_trace(
            TraceSpec(
                duration_s=hours,
                peak_rate=args.peak_rate,
                spikes=max(1, round(8 * args.hours / 6)),  # 8 a day, not stacked when shorter
                seed=args.seed,
            )
        ),
        make_bursty_trace(BurstySpec(duration_s=hours, seed=args.seed + 4)),
        read_access_log(log),
    ]
    run(traces, args, args.out, "autoscaler_sim")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
