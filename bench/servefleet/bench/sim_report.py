"""Tables, JSON and the timeline plot of an autoscaler simulation run."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .sim_cluster import SimResult
from .sim_trace import Trace, rate_at


def summary(results: list[SimResult], slo_target_s: float) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for r in results:
        waits = r.waits_s
        out[r.policy] = {
            "slo_attainment": round(r.slo_attainment(slo_target_s), 4),
            "replica_hours": round(r.replica_hours, 2),
            "p50_wait_s": round(float(_quantile(waits, 0.5)), 3),
            "p99_wait_s": round(float(_quantile(waits, 0.99)), 3),
            "max_replicas": max(r.timeline_replicas, default=0),
            "requests": int(waits.size),
        }
    return out


def table(rows: dict[str, dict[str, float]]) -> str:
    head = f"{'policy':<12} {'SLO attain':>10} {'replica-h':>10} {'p50 wait':>9} {'p99 wait':>9}"
    lines = [head, "-" * len(head)]
    for name, row in rows.items():
        lines.append(
            f"{name:<12} {row['slo_attainment']:>10.2%} {row['replica_hours']:>10.2f} "
            f"{row['p50_wait_s']:>8.2f}s {row['p99_wait_s']:>8.2f}s"
        )
    return "\n".join(lines)


def plot_timeline(trace: Trace, results: list[SimResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (load_ax, rep_ax) = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    if results:
        ts = results[0].timeline_s
        hours = [t / 3600 for t in ts]
        rates = [rate_at(trace.spec, trace.spikes, t) for t in ts]
        load_ax.plot(hours, rates, color="black", lw=0.8, label="offered rate (req/s)")
        load_ax.set_ylabel("requests/s")
        load_ax.legend(loc="upper left")
        for r in results:
            rep_ax.step(
                [t / 3600 for t in r.timeline_s],
                r.timeline_replicas,
                where="post",
                label=r.policy,
                lw=0.9,
            )
    rep_ax.set_ylabel("replicas (incl. starting/draining)")
    rep_ax.set_xlabel("simulated hours")
    rep_ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _quantile(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else 0.0
