"""Same-run ratios of the ISA matrix, all as speed-ups: above 1 is better, below 1 is worse.

Throughputs are divided as they are (arm / reference), latencies and memory the other way
round (reference / arm), so every ratio reads the same direction.
"""

from __future__ import annotations

from typing import Any

from servefleet.bench.isa_workloads import FIGURES
from servefleet.bench.source_trees import CURRENT


def speedup(key: str, arm: float | None, reference: float | None) -> float | None:
    if not arm or not reference:
        return None
    higher_is_better = FIGURES[key][1]
    return arm / reference if higher_is_better else reference / arm


def speedups(figures: dict[str, Any], reference: dict[str, Any]) -> dict[str, float | None]:
    return {key: speedup(key, figures.get(key), reference.get(key)) for key in FIGURES}


def baseline_of(arm: dict[str, Any], arms: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The older commit's arm with the same build, else its same ISA in float32 (an older
    commit may not have had bfloat16 matmuls: then bf16 is compared with what it ran)."""
    older = [a for a in arms if a["tree"] != CURRENT and a["isa_label"] == arm["isa_label"]]
    same = [a for a in older if a["matmul_dtype"] == arm["matmul_dtype"]]
    matches = same or older
    return matches[0] if matches else None


def add_ratios(result: dict[str, Any]) -> None:
    """Add `speedup_vs_default` to every arm and `speedup_vs_baseline` to the current ones."""
    arms = result["arms"]
    default = next(a for a in arms if a["name"] == result["default_arm"])
    for arm in arms:
        arm["speedup_vs_default"] = speedups(arm["figures"], default["figures"])
        base = baseline_of(arm, arms) if arm["tree"] == CURRENT else None
        if base is not None:
            arm["speedup_vs_baseline"] = {
                "baseline_arm": base["name"],
                **speedups(arm["figures"], base["figures"]),
            }
