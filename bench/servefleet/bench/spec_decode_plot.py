"""The speculative-decoding benchmark's PNG: c=1 per-token latency, c=16 throughput."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: no display here
import matplotlib.pyplot as plt


def plot(result: dict[str, Any], path: Path) -> None:
    runs = result["runs"]
    names = list(runs)
    fig, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, workload, metric, label in (
        (latency, "rewrite_c1", "tpot", "ms per output token (TPOT)"),
        (throughput, "random_c16", "tps", "output tokens/s"),
    ):
        if metric == "tpot":
            values = [runs[n][workload]["tpot_ms"]["mean"] or 0.0 for n in names]
        else:
            values = [runs[n][workload]["output_token_throughput_tps"] for n in names]
        bars = ax.bar(names, values, color=["tab:gray", "tab:blue"])
        ax.bar_label(bars, fmt="%.1f")
        ax.set_ylabel(label)
    ratio = result["c1_rewrite_tpot_ratio_plain_over_ngram"] or 0.0
    rate = result["c1_rewrite_acceptance_rate"] or 0.0
    latency.set_title(f"rewrite, c=1: {ratio:.2f}x lower TPOT (acceptance {rate:.0%})")
    tps = result["c16_random_output_tps_ratio_ngram_over_plain"] or 0.0
    throughput.set_title(f"random, c=16: ngram/plain = {tps:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
