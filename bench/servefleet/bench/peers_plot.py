"""The peers benchmark's PNG: one bar per peer for each headline figure; skipped peers say so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: no display here
import matplotlib.pyplot as plt

PANELS = (
    ("output_tps_c1", "output tok/s, c=1"),
    ("output_tps_c16", "output tok/s, c=16"),
    ("itl_p50_ms_c16", "ITL p50 (ms), c=16"),
    ("ttft_p50_ms_c1", "TTFT p50 (ms), c=1"),
    ("shared_prefix_ttft_p50_ms", "shared-prefix TTFT p50 (ms), c=1"),
    ("peak_rss_mb", "peak RSS (MB), process tree"),
)


def _label(peer: dict[str, Any]) -> str:
    if peer["status"] == "measured":
        return str(peer["name"])
    return f"{peer['name']}\n({peer['status']})"


def plot(result: dict[str, Any], path: Path) -> None:
    peers = result["peers"]
    names = [_label(p) for p in peers]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
        values = [p.get(key) or 0.0 for p in peers]
        bars = ax.bar(names, values, color="tab:blue")
        for bar, peer, value in zip(bars, peers, values, strict=True):
            text = f"{value:.1f}" if peer["status"] == "measured" else peer["status"]
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
    reasons = "; ".join(f"{p['name']}: {p['reason']}" for p in peers if p.get("reason"))
    fig.suptitle(
        f"{result['model']} — {result['threads']} threads, {result['parallel']} parallel"
        + (f"\n{reasons}" if reasons else ""),
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
