"""The fault suite: every scenario, one after another, against one stack of real processes
(two engines on the real model, two gateways, Redis), with its figures in a JSON and a PNG.

    python -m servefleet.bench.fault_suite                # the full run (`make soak`)
    python -m servefleet.bench.fault_suite --scale short  # what e2e/test_faults.py runs in CI

Exit status 1 when any scenario broke an invariant: a fault that loses or corrupts anything is
a defect to fix, not a figure to report.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from servefleet.bench.fault_clients import client_disconnect, overload, slow_clients
from servefleet.bench.fault_common import Scale, ScenarioResult
from servefleet.bench.fault_engines import engine_kill, rolling_update, scale_down_drain
from servefleet.bench.fault_processes import engine_drain, gateway_kill, redis_outage
from servefleet.bench.fault_soak import soak
from servefleet.bench.fault_stack import Stack, StackShape

Scenario = Callable[[Stack, Scale], ScenarioResult]
SCENARIOS: dict[str, Scenario] = {
    "client_disconnect": client_disconnect,
    "slow_clients": slow_clients,
    "redis_outage": redis_outage,
    "gateway_kill": gateway_kill,
    "engine_drain": engine_drain,
    "engine_kill": engine_kill,
    "scale_down_drain": scale_down_drain,
    "rolling_update": rolling_update,
    "overload": overload,
    "soak": soak,
}
SHAPE = StackShape(engines=2, gateways=2, max_num_seqs=4)


def run_suite(names: list[str], scale: Scale, workdir: Path) -> list[ScenarioResult]:
    results: list[ScenarioResult] = []
    with Stack(workdir, SHAPE) as stack:
        for name in names:
            print(f"fault scenario {name} ({scale.seconds:g} s of load)", flush=True)
            results.append(SCENARIOS[name](stack, scale))
            verdict = "ok" if not results[-1].violations else "; ".join(results[-1].violations)
            print(f"  {name}: {verdict}", flush=True)
    return results


def write_report(results: list[ScenarioResult], scale: Scale, out: Path) -> None:
    """faults.json (figures and violations per scenario) and faults.png (outcomes per scenario)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    body = {
        "scale_seconds": scale.seconds,
        "scenarios": [
            {"name": r.name, "violations": r.violations, "figures": r.figures} for r in results
        ],
    }
    (out / "faults.json").write_text(json.dumps(body, indent=1))
    outcomes = sorted({o for r in results for o in r.figures.get("load", {}).get("outcomes", {})})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottoms = [0.0] * len(results)
    for outcome in outcomes:
        counts = [r.figures.get("load", {}).get("outcomes", {}).get(outcome, 0) for r in results]
        ax.bar([r.name for r in results], counts, bottom=bottoms, label=outcome)
        bottoms = [b + c for b, c in zip(bottoms, counts, strict=True)]
    ax.set_ylabel("requests")
    ax.set_title(f"Fault suite, {scale.seconds:g} s of load per scenario: outcome of every request")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "faults.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=("short", "full"), default="full")
    parser.add_argument(
        "--seconds", type=float, default=None, help="load per scenario (overrides --scale)"
    )
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), default=None)
    parser.add_argument("--out", type=Path, default=Path("bench/results/faults"))
    args = parser.parse_args(argv)
    scale = Scale.full() if args.scale == "full" else Scale.short()
    if args.seconds is not None:
        scale = Scale(seconds=args.seconds)
    with tempfile.TemporaryDirectory(prefix="servefleet-faults-") as workdir:
        results = run_suite(args.scenario or list(SCENARIOS), scale, Path(workdir))
    write_report(results, scale, args.out)
    print(f"wrote {args.out / 'faults.json'} and {args.out / 'faults.png'}")
    return 1 if any(r.violations for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
