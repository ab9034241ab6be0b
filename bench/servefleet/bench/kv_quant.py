"""int8 vs float32 KV cache on SmolLM2: sequences a fixed cache holds, and decode speed.

Capacity is the engine's own arithmetic (`kv_bytes_per_block`: int8 rows carry a float32
scale per token and kv head): blocks in `--cache-mib`, and how many sequences of
`PROMPT_TOKENS + steps` tokens fit at once. Speed is greedy decode tok/s at concurrency 1 and
16 over the same prompts, the model loaded as `servefleet engine` loads it (packed weights, C
matmuls and C attention, fused RoPE/KV-write ops and the one-call decode program, which
quantize int8 rows on write). Each figure is the best of `--repeats` runs, the dtypes
interleaved, so a load spike on a shared machine does not land on one dtype only.

    uv run python -m servefleet.bench.kv_quant [--cache-mib 256] [--steps 32] [--repeats 3] \
        [--threads N] [--out bench/results/kv_quant]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from servefleet.bench.quant_formats import PROMPT_TOKENS, decode_seconds

BUILTIN = "smollm2-135m-instruct"
DTYPES = ("float32", "int8")
CONCURRENCIES = (1, 16)
SEQUENCE_TOKENS = PROMPT_TOKENS + 64  # the length capacity is counted in
BLOCK = 16


def capacity(config: object, dtype: str, cache_bytes: int) -> dict[str, int]:
    """Blocks, bytes per token and concurrent SEQUENCE_TOKENS-long sequences in cache_bytes."""
    import torch

    from servefleet.engine.model.config import ModelConfig
    from servefleet.engine.model.kv_layout import kv_bytes_per_block

    assert isinstance(config, ModelConfig)
    per_block = kv_bytes_per_block(config, BLOCK, getattr(torch, dtype))
    blocks = cache_bytes // per_block
    return {
        "bytes_per_token": per_block // BLOCK,
        "blocks": blocks,
        "max_concurrent_seqs": blocks // -(-SEQUENCE_TOKENS // BLOCK),
    }


def best_tok_s(model: object, steps: int, repeats: int) -> dict[str, dict[str, float]]:
    """Best decode tok/s per dtype and concurrency over `repeats` interleaved runs."""
    best: dict[str, dict[str, float]] = {d: {} for d in DTYPES}
    for _ in range(repeats):
        for concurrency in CONCURRENCIES:
            for dtype in DTYPES:
                key = f"decode_tok_s_c{concurrency}"
                tok_s = concurrency * steps / decode_seconds(model, concurrency, steps, dtype)
                best[dtype][key] = round(max(best[dtype].get(key, 0.0), tok_s), 2)
    return best


def run(
    cache_mib: int, steps: int, out: Path, repeats: int = 3, threads: int | None = None
) -> dict[str, object]:
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    import torch

    if threads:  # one thread: no OpenMP team spinning against other jobs on a shared box
        torch.set_num_threads(threads)

    from servefleet.engine.config import EngineConfig
    from servefleet.engine.process import load_for

    loaded = load_for(EngineConfig(model=BUILTIN))
    results: dict[str, dict[str, object]] = {}
    with torch.inference_mode():
        speeds = best_tok_s(loaded.model, steps, repeats)
    for dtype in DTYPES:
        row: dict[str, object] = dict(capacity(loaded.config, dtype, cache_mib << 20))
        row.update(speeds[dtype])
        results[dtype] = row
    base, int8 = results["float32"], results["int8"]
    summary: dict[str, object] = {
        "model": BUILTIN,
        "cache_mib": cache_mib,
        "sequence_tokens": SEQUENCE_TOKENS,
        "decode_steps": steps,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "dtypes": results,
        "int8_over_float32": {
            key: round(float(int8[key]) / float(base[key]), 3)  # type: ignore[arg-type]
            for key in ("blocks", "max_concurrent_seqs", "decode_tok_s_c1", "decode_tok_s_c16")
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_quant.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(results, cache_mib, out / "kv_quant.png")
    return summary


def plot(results: dict[str, dict[str, object]], cache_mib: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (f"concurrent {SEQUENCE_TOKENS}-token sequences in {cache_mib} MiB", "max_concurrent_seqs"),
        ("decode tok/s, c=1", "decode_tok_s_c1"),
        ("decode tok/s, c=16", "decode_tok_s_c16"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 4))
    names = list(results)
    for ax, (title, key) in zip(axes, panels, strict=True):
        values = [float(results[n][key]) for n in names]  # type: ignore[arg-type]
        ax.bar(names, values, color=["tab:blue", "tab:orange"])
        for x, v in enumerate(values):
            ax.annotate(f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=9)
        ax.set_title(title)
    fig.suptitle("SmolLM2-135M: float32 vs int8 KV cache (same prompts, same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-mib", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; best kept")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv_quant"))
    args = parser.parse_args(argv)
    summary = run(args.cache_mib, args.steps, args.out, args.repeats, args.threads)
    print(json.dumps(summary["int8_over_float32"]))


if __name__ == "__main__":
    main()
