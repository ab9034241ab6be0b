"""`servefleet sim --trace FILE`: what each scaling policy would have cost on logged traffic.

Replays a gateway access log (one `servefleet.api.access_log.AccessLogLine` per line) through
the autoscaler simulator: our policy, HPA-, KEDA- and KubeAI-style autoscalers and fixed pools,
each over its settings, and prints SLO attainment against cost. `--warm-minimums 0,1,2`
answers "what warm pool meets my SLO?". Writes `<out>/sim.json` and `<out>/sim.png`.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from servefleet.bench.sim_run import add_sweep_arguments

    parser.add_argument("--trace", type=Path, required=True, help="gateway access log (JSON lines)")
    parser.add_argument("--deployment", default=None, help="replay only this deployment's lines")
    parser.add_argument("--out", type=Path, default=Path("sim-results"))
    add_sweep_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from servefleet.bench.sim_access_log import read_access_log
    from servefleet.bench.sim_run import run as run_sweep

    trace = read_access_log(args.trace, args.deployment)
    run_sweep([trace], args, args.out, "sim")
    return 0
