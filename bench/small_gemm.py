"""Decode-step matmuls on the SmolLM2 shapes: torch (MKL) vs the C few-row kernels.

One "step" is every projection of the 30 layers ([in, out] weights: qkv 576x960,
o 576x576, gate/up 576x3072, down 1536x576) plus the lm_head (x @ embed.T, embed
[49152, 576]). Each layer has its own weights (424 MB in all), so they stream from
DRAM as in the engine rather than sitting in cache. Steps alternate between the
backends so both see the same machine load; the median step is reported.

`--crossover` also times row counts up to 64 per backend and kernel shape, which
is how `SMALL_MM_MAX_ROWS` was picked.

Prints one JSON line; writes the JSON and a PNG plot (same stem) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # AMX bf16 faults on some VMs

import torch
import torch.nn.functional as F

from servefleet.engine.kernels.cpu_small_gemm import CpuSmallGemm, load_cpu_small_gemm
from servefleet.engine.kernels.matmul import SmallRowsMatmul

LAYERS = 30
PROJECTIONS = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N), [in, out]
VOCAB, HIDDEN = 49152, 576

MatmulFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def make_weights(seed: int) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    layers = [
        [torch.randn(k, n, generator=generator) / k**0.5 for k, n in PROJECTIONS]
        for _ in range(LAYERS)
    ]
    return layers, torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5


def time_step(
    layers: list[list[torch.Tensor]],
    embed: torch.Tensor,
    rows: int,
    mm: MatmulFn,
    linear: MatmulFn,
) -> tuple[float, float]:
    """(layers ms, lm_head ms) for one step of `rows` rows."""
    xs = {k: torch.randn(rows, k) for k in {k for k, _ in PROJECTIONS}}
    t0 = time.perf_counter()
    for weights in layers:
        for w in weights:
            mm(xs[w.shape[0]], w)
    t1 = time.perf_counter()
    linear(xs[HIDDEN], embed)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def measure(
    layers: list[list[torch.Tensor]],
    embed: torch.Tensor,
    rows: int,
    backends: dict[str, tuple[MatmulFn, MatmulFn]],
    repeats: int,
    warmup: int,
) -> dict[str, dict[str, float]]:
    """Median layers/lm_head/total ms per backend, backends interleaved step by step."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in backends}
    for i in range(warmup + repeats):
        for name, (mm, linear) in backends.items():
            sample = time_step(layers, embed, rows, mm, linear)
            if i >= warmup:
                samples[name].append(sample)
    result: dict[str, dict[str, float]] = {}
    for name, values in samples.items():
        layer_ms = statistics.median(v[0] for v in values)
        head_ms = statistics.median(v[1] for v in values)
        total_ms = statistics.median(v[0] + v[1] for v in values)
        result[name] = {"layers_ms": layer_ms, "lm_head_ms": head_ms, "step_ms": total_ms}
    return result


def plot(rows: list[int], per_rows: dict[int, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in (("torch", "o-"), ("cpu-c", "s-")):
        ax.plot(rows, [per_rows[r][name]["layers_ms"] for r in rows], style, label=name)
        bx.plot(rows, [per_rows[r][name]["lm_head_ms"] for r in rows], style, label=name)
    ax.set_title("30 layers' projections, ms per step")
    bx.set_title("lm_head (x @ embed.T), ms per step")
    for axis in (ax, bx):
        axis.set_xlabel("rows (sequences decoding)")
        axis.set_xticks(rows)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(f"SmolLM2 decode matmuls, float32, {torch.get_num_threads()} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def crossover(per_rows: dict[int, dict[str, dict[str, float]]], part: str) -> int:
    """Largest row count at which the C kernel was faster than torch for `part`."""
    wins = [r for r, res in per_rows.items() if res["cpu-c"][part] < res["torch"][part]]
    return max(wins, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/small_gemm.json"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument(
        "--crossover", action="store_true", help="time rows 1..64 to find the crossover"
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel: CpuSmallGemm | None = load_cpu_small_gemm()
    if kernel is None:
        raise SystemExit("the C kernel could not be built (see the warning above)")
    rows: list[int] = [1, 2, 4, 8, 16, 24, 32, 48, 64] if args.crossover else args.rows
    layers, embed = make_weights(seed=0)
    ours = SmallRowsMatmul(kernel, max_rows=max(rows))  # the engine's call path, no cut-off
    backends: dict[str, tuple[MatmulFn, MatmulFn]] = {
        "torch": (torch.mm, F.linear),
        "cpu-c": (ours.mm, ours.linear),
    }
    per_rows = {r: measure(layers, embed, r, backends, args.repeats, args.warmup) for r in rows}
    weight_bytes = 4 * (LAYERS * sum(k * n for k, n in PROJECTIONS) + VOCAB * HIDDEN)
    summary = {
        "benchmark": "small_gemm",
        "threads": torch.get_num_threads(),
        "isa": kernel.isa,
        "weight_mb": round(weight_bytes / 1e6, 1),
        "rows": {
            str(r): {
                "torch_step_ms": round(res["torch"]["step_ms"], 2),
                "cpu_c_step_ms": round(res["cpu-c"]["step_ms"], 2),
                "torch_over_cpu_c": round(res["torch"]["step_ms"] / res["cpu-c"]["step_ms"], 3),
                "torch_layers_ms": round(res["torch"]["layers_ms"], 2),
                "cpu_c_layers_ms": round(res["cpu-c"]["layers_ms"], 2),
                "torch_lm_head_ms": round(res["torch"]["lm_head_ms"], 2),
                "cpu_c_lm_head_ms": round(res["cpu-c"]["lm_head_ms"], 2),
                "cpu_c_gb_per_s": round(weight_bytes / res["cpu-c"]["step_ms"] / 1e6, 1),
            }
            for r, res in per_rows.items()
        },
        "crossover_rows": {
            "step": crossover(per_rows, "step_ms"),
            "mm": crossover(per_rows, "layers_ms"),
            "linear": crossover(per_rows, "lm_head_ms"),
        },
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    plot(rows, per_rows, args.out.with_suffix(".png"))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
