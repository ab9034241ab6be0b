"""Tables and plots of autoscaler simulations: the frontier per trace."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .sim_frontier import POLICIES, Point, frontier

COLOURS = {
    "servefleet": "tab:blue",
    "hpa": "tab:orange",
    "keda": "tab:green",
    "kubeai": "tab:purple",
    "fixed": "tab:gray",
}


def frontier_table(points: Sequence[Point]) -> str:
    head = f"{'trace':<16} {'policy':<11} {'settings':<32} {'SLO':>8} {'cost':>8} {'rep-h':>8}"
    lines = [head, "-" * len(head)]
    for p in sorted(points, key=lambda p: (p.trace, POLICIES.index(p.policy), p.cost)):
        settings = ",".join(f"{k}={v:g}" for k, v in p.settings.items())
        lines.append(
            f"{p.trace:<16} {p.policy:<11} {settings:<32} {p.slo_attainment:>8.2%} "
            f"{p.cost:>8.2f} {p.replica_hours:>8.2f}"
        )
    return "\n".join(lines)


def plot_frontiers(points_by_trace: dict[str, list[Point]], path: Path) -> None:
    """One panel per trace: every run as a dot, each policy's frontier as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(points_by_trace))
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 5), squeeze=False)
    for ax, (trace, points) in zip(axes[0], points_by_trace.items(), strict=False):
        for policy in POLICIES:
            mine = [p for p in points if p.policy == policy]
            if not mine:
                continue
            colour = COLOURS[policy]
            ax.scatter(
                [p.cost for p in mine],
                [100 * p.slo_attainment for p in mine],
                s=14,
                color=colour,
                alpha=0.5,
            )
            best = frontier(mine)
            ax.step(
                [p.cost for p in best],
                [100 * p.slo_attainment for p in best],
                where="post",
                color=colour,
                label=policy,
                lw=1.4,
            )
        ax.axhline(99, color="black", lw=0.6, ls=":")
        ax.set_title(trace)
        ax.set_xlabel("cost (replica-hours, spill-over priced in)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(bottom=max(0.0, ax.get_ylim()[0]))
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    points_by_trace: dict[str, list[Point]],
    traces: dict[str, dict[str, object]],
    verdicts: dict[str, dict[str, Any]],
    params: dict[str, object],
    out: Path,
    stem: str = "autoscaler_sim",
) -> dict[str, object]:
    """`<out>/<stem>.json` (every point, frontier and verdict per trace) and `<stem>.png`."""
    report: dict[str, object] = {
        "benchmark": stem,
        "params": params,
        "traces": {
            name: {
                **traces[name],
                "verdict": verdicts[name],
                "frontier": {
                    policy: [
                        p.model_dump() for p in frontier([q for q in points if q.policy == policy])
                    ]
                    for policy in POLICIES
                },
                "points": [p.model_dump() for p in points],
            }
            for name, points in points_by_trace.items()
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    plot_frontiers(points_by_trace, out / f"{stem}.png")
    return report
