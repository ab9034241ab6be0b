"""The ISA matrix's PNG (grouped bars: each figure's speed-up over the default arm) and its
markdown table (what bench/README.md shows for each machine kind).

    uv run python -m servefleet.bench.isa_report bench/results/isa_matrix.json   # the table
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: no display here
import matplotlib.pyplot as plt

from servefleet.bench.isa_workloads import FIGURES


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def heading(result: dict[str, Any]) -> str:
    cpu = result["cpu"]
    isa = ", ".join(f for f, on in cpu["isa_flags"].items() if on) or "none of " + ", ".join(
        cpu["isa_flags"]
    )
    load = result["load_average"]
    return (
        f"{cpu['model']}, {cpu['cores']} cores ({isa}); {result['date']}; "
        f"{result['threads']} engine threads; {result['conditions']} "
        f"(load average {load['before']} before, {load['after']} after)"
        + ("; --quick" if result["quick"] else "")
    )


def markdown_table(result: dict[str, Any]) -> str:
    """Absolute figures with the speed-up over the default arm, then current vs the older
    commit per build (speed-ups: above 1 better, latencies and RSS inverted)."""
    keys = list(FIGURES)
    head = "| arm | commit | " + " | ".join(FIGURES[k][0] for k in keys) + " |"
    rule = "| --- " * (len(keys) + 2) + "|"
    lines = [heading(result), "", head, rule]
    for arm in result["arms"]:
        cells = [
            f"{_fmt(arm['figures'].get(k))} ({_ratio(arm['speedup_vs_default'].get(k))})"
            for k in keys
        ]
        lines.append(f"| {arm['name']} | {arm['commit']} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"(×: speed-up over {result['default_arm']}; above 1 is better)")
    versus = [a for a in result["arms"] if "speedup_vs_baseline" in a]
    if versus:
        lines += ["", "| current arm | vs | " + " | ".join(FIGURES[k][0] for k in keys) + " |"]
        lines.append(rule)
        for arm in versus:
            vs = arm["speedup_vs_baseline"]
            cells = [_ratio(vs.get(k)) for k in keys]
            lines.append(f"| {arm['name']} | {vs['baseline_arm']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """One group per figure, one bar per arm: its speed-up over the default arm."""
    arms = result["arms"]
    keys = list(FIGURES)
    width = 0.8 / max(1, len(arms))
    fig, ax = plt.subplots(figsize=(max(10, 2 * len(keys)), 6))
    for i, arm in enumerate(arms):
        ratios = [arm["speedup_vs_default"].get(k) or 0.0 for k in keys]
        xs = [j + i * width for j in range(len(keys))]
        bars = ax.bar(xs, ratios, width, label=f"{arm['name']} ({arm['commit']})")
        for bar, key in zip(bars, keys, strict=True):
            value = arm["figures"].get(key)
            ax.annotate(
                _fmt(value, 0),
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(arms) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels([FIGURES[k][0] for k in keys], fontsize=8, rotation=15)
    ax.set_ylabel(f"speed-up over {result['default_arm']} (>1 better)")
    ax.legend(fontsize=8)
    ax.set_title(heading(result), fontsize=8, wrap=True)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m servefleet.bench.isa_report ISA_MATRIX_JSON", file=sys.stderr)
        return 2
    print(markdown_table(json.loads(Path(args[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
