"""Prefill matmuls on packed weights: the blocked C kernel against unpack + MKL.

SmolLM2-135M's projection shapes (qkv 576→960, o 576→576, gate_up 576→3072, down
1536→576; Q4_1 as its GGUF stores them, random values) and its Q8_0 lm_head (49152×576,
on the last row only, as a prefill computes it) at M = 64, 256, 512, 1024 prompt rows:
- `blocked`: `sf_big_packed_mm` (one L2-sized panel of W unpacked at a time, every row
  through it; what `SmallRowsMatmul` runs for many-row calls by default);
- `unpack-mkl`: the whole weight unpacked into a reused float32 buffer, then `torch.mm`
  (the path before);
- `dense-blocked` / `dense-mkl`: the same on float32 weights (`sf_big_mm` vs `torch.mm`).
One layer's four projections are timed and counted 30 times (each layer's weights are
distinct and larger than L2 either way), plus the lm_head: ms per whole-model prefill of
M tokens. Configurations run in turn, round after round, each keeping its fastest:
on a shared machine, compare the same run's ratios. The AVX2 build runs in a child
process (`SERVEFLEET_MATMUL_ISA=avx2`) in the same run. Writes JSON and a PNG.

    uv run python -m servefleet.bench.prefill_gemm [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from servefleet.bench.bench_output import save_result

LAYERS = 30
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (K, N) of qkv, o, gate_up, down
VOCAB = 49152
ROWS = (64, 256, 512, 1024)
PATHS = ("blocked", "unpack-mkl", "dense-blocked", "dense-mkl")
ISA_ENV = "SERVEFLEET_MATMUL_ISA"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--child", action="store_true", help="measure this build only, JSON out")
    p.add_argument("--out", type=Path, default=Path("bench/results/prefill_gemm/prefill_gemm.json"))
    return p.parse_args(argv)


def _best_ms(step: Callable[[], object], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def measure(rows: list[int], rounds: int) -> dict[str, Any]:
    """ms per whole-model prefill, per path and row count, for this process's build."""
    import numpy as np
    import torch

    from servefleet.bench.quant_models import random_blocks
    from servefleet.engine.kernels.cpu_small_gemm import load_cpu_small_gemm
    from servefleet.engine.kernels.matmul import UnpackScratch
    from servefleet.engine.kernels.packed_weights import pack
    from servefleet.engine.model.gguf_blocks import from_gguf_blocks

    isa = os.environ.get(ISA_ENV, "native")
    kernel = load_cpu_small_gemm("openmp", isa)
    assert kernel is not None, "needs the C kernels (a C compiler)"
    rng = np.random.default_rng(0)

    def packed(type_name: str, k: int, n: int) -> Any:
        return pack(from_gguf_blocks(type_name, random_blocks(type_name, n, k, rng), n, k))

    weights = [packed("Q4_1", k, n) for k, n in SHAPES]
    dense = [kernel.unpack(w) for w in weights]
    lm_head = packed("Q8_0", SHAPES[0][0], VOCAB)
    scratch = UnpackScratch()
    steps: dict[str, Callable[[list[torch.Tensor]], object]] = {
        "blocked": lambda xs: [
            kernel.packed_mm(x, w, blocked=True) for x, w in zip(xs, weights, strict=True)
        ],
        "unpack-mkl": lambda xs: [
            torch.mm(x, scratch.unpacked(kernel, w)) for x, w in zip(xs, weights, strict=True)
        ],
        "dense-blocked": lambda xs: [
            kernel.mm(x, w, blocked=True) for x, w in zip(xs, dense, strict=True)
        ],
        "dense-mkl": lambda xs: [torch.mm(x, w) for x, w in zip(xs, dense, strict=True)],
    }
    last = torch.randn(1, SHAPES[0][0])
    head_ms = _best_ms(lambda: kernel.packed_mm(last, lm_head), rounds)
    ms: dict[str, dict[str, float]] = {path: {} for path in PATHS}
    for m in rows:
        xs = [torch.randn(m, k) for k, _ in SHAPES]
        for path in PATHS:  # warm: scratch buffers, panels, MKL's packing
            steps[path](xs)
        best = {path: float("inf") for path in PATHS}
        for _ in range(rounds):  # in turn, round after round: load hits all alike
            for path in PATHS:
                best[path] = min(best[path], _best_ms(functools.partial(steps[path], xs), 1))
        for path in PATHS:
            ms[path][str(m)] = round(LAYERS * best[path] + head_ms, 2)
    return {"isa": kernel.isa, "threads": torch.get_num_threads(), "prefill_ms": ms}


def run_avx2_child(args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, "-m", "servefleet.bench.prefill_gemm", "--child"]
    command += ["--rounds", str(args.rounds), "--rows", *map(str, args.rows)]
    done = subprocess.run(
        command, env={**os.environ, ISA_ENV: "avx2"}, capture_output=True, text=True, check=True
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def ratios(build: dict[str, Any]) -> dict[str, dict[str, float]]:
    """unpack-mkl / blocked and dense-mkl / dense-blocked: > 1 means the blocked kernel wins."""
    ms = build["prefill_ms"]
    return {
        "packed_mkl_over_blocked": {
            m: round(ms["unpack-mkl"][m] / v, 2) for m, v in ms["blocked"].items()
        },
        "dense_mkl_over_blocked": {
            m: round(ms["dense-mkl"][m] / v, 2) for m, v in ms["dense-blocked"].items()
        },
    }  # fmt: skip


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    builds = result["builds"]
    fig, axes = plt.subplots(1, len(builds), figsize=(5.5 * len(builds), 3.8), squeeze=False)
    for ax, (name, build) in zip(axes[0], builds.items(), strict=True):
        for label, series in build["prefill_ms"].items():
            rows = [int(m) for m in series]
            ax.plot(rows, list(series.values()), marker="o", label=label)
        ax.set_title(f"{name} build ({build['isa']}, {build['threads']} threads)")
        ax.set_xlabel("prompt rows M")
        ax.set_ylabel("ms per SmolLM2 prefill (matmuls)")
        ax.legend(fontsize=8)
    fig.suptitle("blocked C kernel vs unpack + MKL (shared machine: compare within a panel)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.rows, args.rounds)))
        return 0
    builds = {"native": measure(args.rows, args.rounds), "avx2": run_avx2_child(args)}
    result = {
        "layers": LAYERS, "shapes_k_n": SHAPES, "vocab": VOCAB,
        "rounds": args.rounds, "builds": builds,
        "ratios": {name: ratios(build) for name, build in builds.items()},
        "load_average": os.getloadavg(),
    }  # fmt: skip
    result = save_result(args.out, "prefill_gemm", result, plot)
    print(json.dumps(result["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
