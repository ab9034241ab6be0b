"""Where a LoRA decode step's time goes: one decode step of 16 sequences (SmolLM2, context
160) with 0, 1, 4, 8 and 16 adapters, through the one-call C program with the adapters
inside (adapters held in bfloat16, the engine's choice under the C kernel, and in float32),
the per-layer path with the C LoRA kernel (bfloat16), and the per-layer path in PyTorch
(float32, as before the C kernel and as `--matmul torch` holds them).

The adapters are `lora_throughput`'s (rank 16 on all seven projections, made by
`make_adapters` when missing). Every configuration is timed in turn, round after round, and
each keeps its fastest step: on a shared machine a burst of other work slows some steps of
some configurations, not the comparison. Writes JSON and a PNG.

    uv run python -m servefleet.bench.lora_step [--rounds 15] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MIXES = (0, 1, 4, 8, 16)
PATHS = ("program", "c-kernel", "torch")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--adapters", type=Path, default=Path("bench/results/lora_adapters"))
    p.add_argument("--out", type=Path, default=Path("bench/results/lora_step.json"))
    return p.parse_args(argv)


def step_runner(args: argparse.Namespace) -> tuple[Any, Any]:
    """The engine's model, and a function timing one decode step of a configuration."""
    import torch

    from servefleet.bench.lora_throughput import make_adapters
    from servefleet.engine.attention import AttentionMetadata
    from servefleet.engine.config import EngineConfig
    from servefleet.engine.lora.adapter import load_adapter
    from servefleet.engine.lora.batch import LoraBatch
    from servefleet.engine.model.kv_layout import allocate_kv_cache
    from servefleet.engine.process import load_for

    loaded = load_for(EngineConfig(model="smollm2-135m-instruct", device="cpu", dtype="float32"))
    model, config = loaded.model, loaded.config
    paths = make_adapters(args.adapters, max(MIXES), 16)
    adapters = {
        dtype: [load_adapter(f"a{i}", p, config, 16, dtype) for i, p in enumerate(paths)]
        for dtype in (torch.bfloat16, torch.float32)
    }
    rows, ctx, block = args.rows, args.context, 16
    blocks = -(-(ctx + 1) // block)
    kv = allocate_kv_cache(config, rows * blocks, block, torch.float32, "cpu")
    tables = torch.arange(rows * blocks, dtype=torch.int32).view(rows, blocks)
    positions = torch.full((rows,), ctx)
    slots = tables[:, ctx // block].long() * block + ctx % block
    ids = torch.randint(0, config.vocab_size, (rows,))
    kernel = model.lora_kernel

    def one_step(count: int, path: str, dtype: torch.dtype) -> float:
        spans = [(adapters[dtype][r % count], r, 1) for r in range(rows)] if count else []
        spans.sort(key=lambda s: s[0].name)  # the runner puts one adapter's rows together
        lora = LoraBatch.for_spans([(a, r, 1) for r, (a, _, _) in enumerate(spans)], "cpu")
        meta = AttentionMetadata(
            slot_mapping=slots, block_size=block, num_decodes=rows, decode_block_tables=tables,
            decode_context_lens=(positions + 1).int(), lora=lora if count else None,
        )  # fmt: skip
        model.one_call_decode = path == "program"
        model.set_lora_kernel(None if path == "torch" else kernel)
        with torch.inference_mode():
            started = time.perf_counter()
            model(ids, positions, kv, meta)
            seconds = time.perf_counter() - started
        model.one_call_decode = True
        model.set_lora_kernel(kernel)
        want = {"program": "program", "c-kernel": "cpu-c", "torch": "torch"}[path]
        assert not count or lora.ran == {want}, (path, lora.ran)
        return seconds * 1000

    return model, one_step


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    _, one_step = step_runner(args)
    configs = [(0, "program", torch.bfloat16)] + [
        (count, path, dtype)
        for count in MIXES[1:]
        for path in PATHS
        for dtype in (torch.bfloat16, torch.float32)
        if path == "program" or (dtype == torch.bfloat16) == (path == "c-kernel")
    ]
    best = {c: float("inf") for c in configs}
    for _ in range(args.rounds):
        for c in configs:
            best[c] = min(best[c], one_step(*c))
    return {
        f"{count}-{path}-{str(dtype).removeprefix('torch.')}": round(ms, 2)
        for (count, path, dtype), ms in best.items()
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = result["step_ms"]
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    lines = {"program, bf16": "program-bfloat16", "program, f32": "program-float32",
             "per-layer C kernel": "c-kernel-bfloat16", "PyTorch": "torch-float32"}  # fmt: skip
    for label, key in lines.items():
        ax.plot(MIXES[1:], [ms[f"{n}-{key}"] for n in MIXES[1:]], marker="o", label=label)
    ax.axhline(ms["0-program-bfloat16"], color="#777", linestyle="--", label="base model")
    ax.set_xlabel("adapters in the step")
    ax.set_ylabel(f"ms per decode step ({result['rows']} rows)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from servefleet.engine.cpu_isa import cpu_flags, ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    args = parse_args(argv)
    result = {
        "benchmark": "lora_step", "rows": args.rows, "context": args.context,
        "rounds": args.rounds, "matmul_isa": os.environ.get("SERVEFLEET_MATMUL_ISA", "auto"),
        "cpu_flags": sorted(cpu_flags()), "step_ms": measure(args),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["step_ms"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
