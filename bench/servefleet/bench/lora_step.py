"""Where a LoRA step's time goes: one decode step of 16 sequences (SmolLM2, context 160)
with 0, 1, 4, 8 and 16 adapters, through the one-call C program with the adapters inside
(adapters held in bfloat16, the engine's choice under the C kernel, and in float32), the
per-layer path with the C LoRA kernel (bfloat16), and the per-layer path in PyTorch
(float32, as before the C kernel and as `--matmul torch` holds them); and one prompt step
of 8 prompts of 130 tokens with 0, 1, 4 and 8 adapters, through the C kernel (bfloat16
and float32 adapters) and PyTorch (float32).

The adapters are `lora_throughput`'s (rank 16 on all seven projections, made by
`make_adapters` when missing). Every configuration is timed in turn, round after round, and
each keeps its fastest step: on a shared machine a burst of other work slows some steps of
some configurations, not the comparison. Writes JSON and a PNG.

    uv run python -m servefleet.bench.lora_step [--rounds 15] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from servefleet.bench.bench_output import save_result

MIXES = (0, 1, 4, 8, 16)
PATHS = ("program", "c-kernel", "torch")
PROMPT_MIXES = (0, 1, 4, 8)
KERNEL: list[Any] = []  # the model's LoRA kernel, as loaded


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=130)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--adapters", type=Path, default=Path("bench/results/lora_adapters"))
    p.add_argument("--out", type=Path, default=Path("bench/results/lora_step.json"))
    return p.parse_args(argv)


def load_model(args: argparse.Namespace) -> tuple[Any, Any, dict[Any, list[Any]]]:
    """The engine's model (its LoRA kernel kept in `KERNEL`: the steps switch it off and
    on), its config, and the adapters in bfloat16 and float32."""
    import torch

    from servefleet.bench.lora_throughput import make_adapters
    from servefleet.engine.config import EngineConfig
    from servefleet.engine.lora.adapter import load_adapter
    from servefleet.engine.process import load_for

    loaded = load_for(EngineConfig(model="smollm2-135m-instruct", device="cpu", dtype="float32"))
    paths = make_adapters(args.adapters, max(MIXES), 16)
    adapters = {
        dtype: [load_adapter(f"a{i}", p, loaded.config, 16, dtype) for i, p in enumerate(paths)]
        for dtype in (torch.bfloat16, torch.float32)
    }
    KERNEL.append(loaded.model.lora_kernel)
    return loaded.model, loaded.config, adapters


def timed_step(model: Any, path: str, lora: Any, step: Any) -> float:
    """Milliseconds of one model call on `path`; checks the path that ran."""
    import torch

    model.one_call_decode = path == "program"
    model.set_lora_kernel(None if path == "torch" else KERNEL[0])
    try:
        with torch.inference_mode():
            started = time.perf_counter()
            step()
            seconds = time.perf_counter() - started
    finally:
        model.one_call_decode = True
    want = {"program": "program", "c-kernel": "cpu-c", "torch": "torch"}[path]
    assert lora is None or lora.ran == {want}, (path, lora.ran)
    return seconds * 1000


def decode_runner(args: argparse.Namespace, model: Any, config: Any, adapters: Any) -> Any:
    """A function timing one decode step of `rows` sequences at `context`."""
    import torch

    from servefleet.engine.attention import AttentionMetadata
    from servefleet.engine.lora.batch import LoraBatch
    from servefleet.engine.model.kv_layout import allocate_kv_cache

    rows, ctx, block = args.rows, args.context, 16
    blocks = -(-(ctx + 1) // block)
    kv = allocate_kv_cache(config, rows * blocks, block, torch.float32, "cpu")
    tables = torch.arange(rows * blocks, dtype=torch.int32).view(rows, blocks)
    positions = torch.full((rows,), ctx)
    slots = tables[:, ctx // block].long() * block + ctx % block
    ids = torch.randint(0, config.vocab_size, (rows,))

    def one_step(count: int, path: str, dtype: torch.dtype) -> float:
        # the runner puts one adapter's rows side by side
        chosen = sorted(
            (adapters[dtype][r % count] for r in range(rows if count else 0)), key=lambda a: a.name
        )
        lora = LoraBatch.for_spans([(a, r, 1) for r, a in enumerate(chosen)], "cpu")
        meta = AttentionMetadata(
            slot_mapping=slots, block_size=block, num_decodes=rows, decode_block_tables=tables,
            decode_context_lens=(positions + 1).int(), lora=lora if count else None,
        )  # fmt: skip
        return timed_step(model, path, meta.lora, lambda: model(ids, positions, kv, meta))

    return one_step


def prompt_runner(args: argparse.Namespace, model: Any, config: Any, adapters: Any) -> Any:
    """A function timing one prompt step: `prompts` whole prompts of `prompt_tokens` each,
    prompt i under adapter i mod count (the runner's layout: one run of rows per prompt)."""
    import torch

    from servefleet.engine.attention import AttentionMetadata, PrefillSpan
    from servefleet.engine.lora.batch import LoraBatch
    from servefleet.engine.model.kv_layout import allocate_kv_cache

    prompts, tokens, block = args.prompts, args.prompt_tokens, 16
    blocks = -(-tokens // block)
    kv = allocate_kv_cache(config, prompts * blocks, block, torch.float32, "cpu")
    tables = torch.arange(prompts * blocks).view(prompts, blocks)
    offsets = torch.arange(tokens)
    slots = (tables[:, offsets // block] * block + offsets % block).reshape(-1)
    positions = offsets.repeat(prompts)
    ids = torch.randint(0, config.vocab_size, (prompts * tokens,))
    spans = [PrefillSpan(i * tokens, (i + 1) * tokens, 0, tables[i]) for i in range(prompts)]

    def one_step(count: int, path: str, dtype: torch.dtype) -> float:
        lora = LoraBatch.for_spans(
            [(adapters[dtype][i % count], i * tokens, tokens) for i in range(prompts)], "cpu"
        ) if count else None  # fmt: skip
        meta = AttentionMetadata(slot_mapping=slots, block_size=block, prefills=spans, lora=lora)
        return timed_step(model, path, lora, lambda: model(ids, positions, kv, meta))

    return one_step


def fastest(configs: list[Any], one_step: Any, rounds: int) -> dict[str, float]:
    """Each configuration's fastest step over `rounds` rounds of all of them in turn."""
    best = {c: float("inf") for c in configs}
    for _ in range(rounds):
        for c in configs:
            best[c] = min(best[c], one_step(*c))
    return {
        f"{count}-{path}-{str(dtype).removeprefix('torch.')}": round(ms, 2)
        for (count, path, dtype), ms in best.items()
    }


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    import torch

    model, config, adapters = load_model(args)
    bf16, f32 = torch.bfloat16, torch.float32
    decode = [(0, "program", bf16)] + [
        (count, path, dtype)
        for count in MIXES[1:]
        for path in PATHS
        for dtype in (bf16, f32)
        if path == "program" or (dtype == bf16) == (path == "c-kernel")
    ]
    prompt = [(0, "c-kernel", bf16)] + [
        (count, path, dtype)
        for count in PROMPT_MIXES[1:]
        for path, dtype in (("c-kernel", bf16), ("c-kernel", f32), ("torch", f32))
    ]
    return {
        "step_ms": fastest(decode, decode_runner(args, model, config, adapters), args.rounds),
        "prompt_step_ms": fastest(
            prompt, prompt_runner(args, model, config, adapters), max(3, args.rounds // 3)
        ),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms, prompt = result["step_ms"], result["prompt_step_ms"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.5))
    lines = {"program, bf16": "program-bfloat16", "program, f32": "program-float32",
             "per-layer C kernel": "c-kernel-bfloat16", "PyTorch": "torch-float32"}  # fmt: skip
    for label, key in lines.items():
        ax.plot(MIXES[1:], [ms[f"{n}-{key}"] for n in MIXES[1:]], marker="o", label=label)
    ax.axhline(ms["0-program-bfloat16"], color="#777", linestyle="--", label="base model")
    ax.set_xlabel("adapters in the step")
    ax.set_ylabel(f"ms per decode step ({result['rows']} rows)")
    lines = {"C kernel, bf16": "c-kernel-bfloat16", "C kernel, f32": "c-kernel-float32",
             "PyTorch, f32": "torch-float32"}  # fmt: skip
    for label, key in lines.items():
        counts = PROMPT_MIXES[1:]
        bx.plot(counts, [prompt[f"{n}-{key}"] for n in counts], marker="o", label=label)
    bx.axhline(prompt["0-c-kernel-bfloat16"], color="#777", linestyle="--", label="base model")
    bx.set_xlabel("adapters in the step")
    bx.set_ylabel(f"ms per prompt step ({result['prompts']} × {result['prompt_tokens']})")
    for axis in (ax, bx):
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    args = parse_args(argv)
    result = {
        "rows": args.rows, "context": args.context, "rounds": args.rounds,
        "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, **measure(args),
    }  # fmt: skip
    result = save_result(args.out, "lora_step", result, plot)
    print(json.dumps({k: result[k] for k in ("step_ms", "prompt_step_ms")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
