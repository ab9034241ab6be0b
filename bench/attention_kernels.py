"""Decode-attention kernels on the serving shape: PyTorch reference vs the C kernel (vs Triton).

One "step" is what the engine does per decode step: every layer's decode attention
over that layer's own KV pool (30 separate pools, as in the engine, so caches are
not artificially hot). A second timing interleaves each layer's projection/MLP
matmuls, because a kernel that leaves threads spinning would show up there as
slower matmuls rather than as a slower kernel.

Prints one JSON line; writes the JSON and a PNG bar chart (same stem) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # AMX bf16 faults on some VMs

import torch
import torch.nn.functional as F

from servefleet.engine.attention import DecodeKernel, torch_paged_decode
from servefleet.engine.kernels.cpu_paged_decode import (
    DEFAULT_THREADING,
    THREADING_FLAGS,
    load_cpu_paged_decode,
)
from servefleet.engine.kernels.triton_paged_decode import (
    triton_paged_decode,
    triton_unavailable,
)


@dataclass(frozen=True)
class ServingShape:
    """The engine's decode step for SmolLM2-135M with 16 running sequences."""

    num_seqs: int = 16
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    hidden: int = 576
    intermediate: int = 1536
    block_size: int = 16
    min_context: int = 200
    max_context: int = 330
    num_layers: int = 30


@dataclass
class Layer:
    """One layer's decode inputs and weights."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    qkv_weight: torch.Tensor
    o_weight: torch.Tensor
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor


@dataclass
class Workload:
    layers: list[Layer]
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    hidden_states: torch.Tensor
    scale: float


def build_workload(shape: ServingShape, cache_dtype: torch.dtype, device: str) -> Workload:
    """Random contexts in [min, max], blocks scattered over a pool with spare blocks."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(shape.min_context, shape.max_context + 1, (shape.num_seqs,), generator=gen)
    max_blocks = -(-shape.max_context // shape.block_size)
    num_blocks = shape.num_seqs * max_blocks + 64
    perm = torch.randperm(num_blocks, generator=gen)[: shape.num_seqs * max_blocks]
    tables = perm.view(shape.num_seqs, max_blocks).to(torch.int32)
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    q_dim = shape.num_heads * shape.head_dim
    kv_dim = shape.num_kv_heads * shape.head_dim
    layers = []
    for _ in range(shape.num_layers):
        layers.append(
            Layer(
                q=torch.randn(shape.num_seqs, shape.num_heads, shape.head_dim, generator=gen).to(
                    device
                ),
                k_cache=torch.randn(cache_shape, generator=gen).to(device, cache_dtype),
                v_cache=torch.randn(cache_shape, generator=gen).to(device, cache_dtype),
                qkv_weight=torch.randn(q_dim + 2 * kv_dim, shape.hidden, generator=gen).to(device),
                o_weight=torch.randn(shape.hidden, q_dim, generator=gen).to(device),
                gate_up_weight=torch.randn(2 * shape.intermediate, shape.hidden, generator=gen).to(
                    device
                ),
                down_weight=torch.randn(shape.hidden, shape.intermediate, generator=gen).to(device),
            )
        )
    return Workload(
        layers=layers,
        block_tables=tables.to(device),
        context_lens=lens.to(torch.int32).to(device),
        hidden_states=torch.randn(shape.num_seqs, shape.hidden, generator=gen).to(device),
        scale=shape.head_dim**-0.5,
    )


def layer_matmuls(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    qkv = F.linear(x, layer.qkv_weight)
    x = x + F.linear(qkv[:, : layer.o_weight.shape[1]], layer.o_weight)
    gate, up = F.linear(x, layer.gate_up_weight).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, layer.down_weight) * 1e-3


def step_fn(work: Workload, kernel: DecodeKernel | None, matmuls: bool) -> Callable[[], None]:
    def step() -> None:
        x = work.hidden_states
        for layer in work.layers:
            if kernel is not None:
                kernel(
                    layer.q,
                    layer.k_cache,
                    layer.v_cache,
                    work.block_tables,
                    work.context_lens,
                    work.scale,
                )
            if matmuls:
                x = layer_matmuls(layer, x)

    return step


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    cpu_median_ms: float  # CPU time of all threads: spinning or oversubscribed threads show here


def time_interleaved(
    fns: dict[str, Callable[[], None]], repeats: int, warmup: int, sync: Callable[[], None]
) -> dict[str, Timing]:
    """Times every variant once per round, round-robin, so all variants see the same
    background load (the machine may be shared); reports median and best round."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall[name].append((time.perf_counter() - start) * 1e3)
            cpu[name].append((time.process_time() - cpu_start) * 1e3)
    return {
        name: Timing(
            median_ms=statistics.median(wall[name]),
            min_ms=min(wall[name]),
            cpu_median_ms=statistics.median(cpu[name]),
        )
        for name in fns
    }


def max_error(work: Workload, kernel: DecodeKernel) -> float:
    layer = work.layers[0]
    args = (layer.q, layer.k_cache, layer.v_cache, work.block_tables, work.context_lens)
    ref = torch_paged_decode(
        layer.q,
        layer.k_cache.float(),
        layer.v_cache.float(),
        work.block_tables,
        work.context_lens,
        work.scale,
    )
    return float((kernel(*args, work.scale) - ref).abs().max())


def plot(results: dict[str, float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names)), 4))
    bars = ax.bar(names, [results[n] for n in names], color="tab:blue")
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("ms per engine step (median)")
    ax.set_title(title, fontsize=9)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/attention_kernels.json"))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cache-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--no-matmuls", action="store_true", help="skip the interleaved matmul timings"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    shape = ServingShape()
    cache_dtype = getattr(torch, args.cache_dtype)
    use_cuda = torch.cuda.is_available()
    device = "cuda" if use_cuda else "cpu"
    work = build_workload(shape, cache_dtype, device)
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)

    kernels: dict[str, DecodeKernel] = {"torch": torch_paged_decode}
    if not use_cuda:
        for threading in THREADING_FLAGS:
            kernel = load_cpu_paged_decode(threading)
            if kernel is not None:
                kernels[f"cpu-c[{threading}]"] = kernel
    elif triton_unavailable("cuda") is None:
        kernels["triton"] = triton_paged_decode

    variants: dict[str, Callable[[], None]] = {
        f"{name} attn": step_fn(work, kernel, matmuls=False) for name, kernel in kernels.items()
    }
    if not args.no_matmuls:
        variants["matmuls only"] = step_fn(work, None, matmuls=True)
        variants.update(
            {
                f"{name} +matmul": step_fn(work, kernel, matmuls=True)
                for name, kernel in kernels.items()
            }
        )
    load_before = os.getloadavg()[0]
    timings = time_interleaved(variants, args.repeats, args.warmup, sync)
    median = {name: t.median_ms for name, t in timings.items()}
    best = {name: t.min_ms for name, t in timings.items()}
    fast_name = f"cpu-c[{DEFAULT_THREADING}]" if not use_cuda else "triton"
    summary: dict[str, object] = {
        "benchmark": "attention_kernels",
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        # a load above cpu_count means other processes shared the cores during the run
        "load_average_1m": [load_before, os.getloadavg()[0]],
        "cache_dtype": args.cache_dtype,
        "repeats": args.repeats,
        "shape": shape.__dict__,
        "context_lens": work.context_lens.tolist(),
        "ms_per_step_median": median,
        "ms_per_step_min": best,
        "cpu_ms_per_step_median": {name: t.cpu_median_ms for name, t in timings.items()},
        # >0: the matmuls ran slower next to this kernel than on their own
        "matmul_interference_ms_median": {
            name: median[f"{name} +matmul"] - median[f"{name} attn"] - median["matmuls only"]
            for name in kernels
            if f"{name} +matmul" in median
        },
        "max_abs_error_vs_torch": {
            name: max_error(work, k) for name, k in kernels.items() if name != "torch"
        },
    }
    if f"{fast_name} attn" in median:
        summary["default_kernel"] = fast_name
        for stat, table in (("median", median), ("min", best)):
            summary[f"speedup_attention_{stat}"] = table["torch attn"] / table[f"{fast_name} attn"]
            if "torch +matmul" in table:
                summary[f"speedup_step_with_matmuls_{stat}"] = (
                    table["torch +matmul"] / table[f"{fast_name} +matmul"]
                )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    plot(
        median,
        args.out.with_suffix(".png"),
        f"decode attention, {shape.num_layers} layers, {shape.num_seqs} seqs, "
        f"{args.cache_dtype} cache, {torch.get_num_threads()} threads ({device})",
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
