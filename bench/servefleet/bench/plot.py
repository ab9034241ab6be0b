"""The PNG written next to a benchmark's JSON: distributions plus a per-request timeline."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: no display here
import matplotlib.pyplot as plt

from servefleet.bench.client import RequestResult
from servefleet.bench.report import BenchSummary


def plot_run(results: Sequence[RequestResult], summary: BenchSummary, path: Path) -> None:
    ok = [r for r in results if r.ok]
    t0 = min((r.start for r in results), default=0.0)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    p = summary.parameters
    fig.suptitle(
        f"{p.get('workload', '')}  conc={p.get('concurrency', '')}  "
        f"in={p.get('input_tokens', '')} out={p.get('output_tokens', '')}  "
        f"{summary.output_token_throughput_tps:.1f} tok/s  "
        f"{summary.completed} ok / {summary.failed} failed"
    )

    ttfts = [t * 1000 for r in ok if (t := r.ttft) is not None]
    _histogram(axes[0][0], ttfts, "TTFT (ms)", summary.ttft_ms.p50, summary.ttft_ms.p99)
    itls = [x * 1000 for r in ok for x in r.itls]
    _histogram(axes[0][1], itls, "inter-token latency (ms)", summary.itl_ms.p50, summary.itl_ms.p99)

    ax = axes[1][0]
    for row, r in enumerate(results):
        color = "tab:blue" if r.ok else "tab:red"
        ax.hlines(row, r.start - t0, r.end - t0, colors=color, linewidth=1)
        if r.ttft is not None:
            ax.plot(r.start - t0 + r.ttft, row, marker="|", color="black", markersize=4)
    ax.set_xlabel("time since first request (s)")
    ax.set_ylabel("request")
    ax.set_title("per-request timeline (| = first token, red = failed)")

    ax = axes[1][1]
    latencies = sorted(r.latency * 1000 for r in ok)
    if latencies:
        ax.plot(latencies, [(i + 1) / len(latencies) for i in range(len(latencies))])
    ax.set_xlabel("end-to-end latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("latency CDF")
    ax.grid(True, alpha=0.3)

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _histogram(
    ax: plt.Axes, values: list[float], label: str, p50: float | None, p99: float | None
) -> None:
    if values:
        ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:blue", alpha=0.8)
    for value, name, style in ((p50, "p50", "--"), (p99, "p99", ":")):
        if value is not None:
            ax.axvline(value, color="black", linestyle=style, label=f"{name} {value:.1f}")
    if p50 is not None:
        ax.legend()
    ax.set_xlabel(label)
    ax.set_ylabel("count")
    ax.set_title(label)
