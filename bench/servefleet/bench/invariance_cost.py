"""What batch-invariant mode costs on SmolLM2 (float32 CPU): TTFT and decode speed, on vs off.

Invariant mode (`--batch-invariant`, `servefleet.engine.invariance`) sends prompt rows through
the decode kernels: 64-row C matmul calls instead of MKL's blocked GEMM, and attention per
row through the paged decode kernel instead of SDPA. TTFT here is the model time of a
`--prompt-tokens` prompt computed in `--chunk`-token chunks (the engine's default step budget)
plus its last row's logits; decode is batched greedy tok/s at concurrency 16 after a prefill
(`quant_formats.decode_seconds`); each also per CPU second of the process, the steadier
figure on a loaded machine (with `--threads 1`). Pure decode steps run the same kernels in
both modes, so the decode figure shows only noise; a mixed step pays the prefill rate for
its prompt rows.
The modes are interleaved and each figure is the best of `--repeats` runs, in one process,
so a load spike on a shared machine does not land on one mode only; the ratios are the
result, the absolute figures carry the machine's load (recorded).

    uv run python -m servefleet.bench.invariance_cost [--prompt-tokens 1024] [--chunk 512] \
        [--steps 16] [--repeats 3] [--threads N] [--out bench/results/invariance_cost]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from servefleet.bench.bench_output import save_result
from servefleet.bench.quant_formats import decode_seconds

BUILTIN = "smollm2-135m-instruct"
BLOCK = 16
MODES = ("off", "on")


def prefill_seconds(model: object, prompt_tokens: int, chunk: int) -> float:
    """Seconds to compute a random `prompt_tokens` prompt in `chunk`-token chunks and its
    last row's logits (TTFT without the server)."""
    import torch

    from servefleet.engine.attention import AttentionMetadata, PrefillSpan
    from servefleet.engine.model.kv_layout import allocate_kv_cache
    from servefleet.engine.model.llama import LlamaForCausalLM

    assert isinstance(model, LlamaForCausalLM)
    blocks = -(-prompt_tokens // BLOCK)
    kv = allocate_kv_cache(model.config, blocks, BLOCK, torch.float32, "cpu")
    table = torch.arange(blocks)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (prompt_tokens,), generator=generator)
    start = time.perf_counter()
    for first in range(0, prompt_tokens, chunk):
        positions = torch.arange(first, min(first + chunk, prompt_tokens))
        span = PrefillSpan(0, len(positions), first, table[: -(-int(positions[-1] + 1) // BLOCK)])
        slots = table[positions // BLOCK] * BLOCK + positions % BLOCK
        hidden = model(
            prompt[positions], positions, kv, AttentionMetadata(slots, BLOCK, prefills=[span])
        )
    model.compute_logits(hidden[-1:])
    return time.perf_counter() - start


def _timed(call: Callable[[], float]) -> tuple[float, float]:
    """(the call's own wall seconds, the process CPU seconds it took): on a loaded machine
    with one torch thread, CPU time is the cost; wall time is also the queue for a core."""
    cpu = time.process_time()
    wall = call()
    return wall, time.process_time() - cpu


def measure(
    model: object, prompt_tokens: int, chunk: int, steps: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Best TTFT (ms, wall and CPU) and c=16 decode tok/s (wall and CPU) per mode over
    interleaved runs."""
    from servefleet.engine.invariance import apply_batch_invariance
    from servefleet.engine.model.llama import LlamaForCausalLM

    assert isinstance(model, LlamaForCausalLM)
    best: dict[str, dict[str, float]] = {mode: {} for mode in MODES}
    for _ in range(repeats):
        for mode in MODES:
            apply_batch_invariance(model, mode == "on")
            ttft = _timed(lambda: prefill_seconds(model, prompt_tokens, chunk))
            decode = _timed(lambda: decode_seconds(model, 16, steps))
            row = best[mode]
            for key, seconds in (("ttft_ms", ttft[0]), ("ttft_cpu_ms", ttft[1])):
                row[key] = round(min(row.get(key, float("inf")), 1000 * seconds), 1)
            for key, seconds in (
                ("decode_tok_s_c16", decode[0]),
                ("decode_cpu_tok_s_c16", decode[1]),
            ):
                row[key] = round(max(row.get(key, 0.0), 16 * steps / seconds), 2)
    apply_batch_invariance(model, True)
    return best


def run(
    prompt_tokens: int, chunk: int, steps: int, repeats: int, out: Path, threads: int | None
) -> dict[str, object]:
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    import torch

    if threads:
        torch.set_num_threads(threads)
    from servefleet.engine.config import EngineConfig
    from servefleet.engine.invariance import invariance_blocker
    from servefleet.engine.process import load_for

    loaded = load_for(EngineConfig(model=BUILTIN))
    blocker = invariance_blocker(loaded.model)
    if blocker is not None:
        raise SystemExit(f"batch-invariant mode cannot run here: {blocker}")
    load_before = os.getloadavg()[0]
    with torch.inference_mode():
        modes = measure(loaded.model, prompt_tokens, chunk, steps, repeats)
    on, off = modes["on"], modes["off"]
    summary: dict[str, object] = {
        "model": BUILTIN,
        "prompt_tokens": prompt_tokens,
        "chunk": chunk,
        "decode_steps": steps,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cpu_count": os.cpu_count(),
        "modes": modes,
        "on_over_off": {key: round(on[key] / off[key], 3) for key in on},
    }
    return save_result(out / "invariance_cost.json", "invariance_cost", summary, plot)


def plot(summary: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = summary["modes"]
    assert isinstance(modes, dict)
    panels = [
        (f"TTFT ms, {summary['prompt_tokens']}-token prompt", "ttft_ms"),
        ("decode tok/s, c=16", "decode_tok_s_c16"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(9, 4))
    for ax, (title, key) in zip(axes, panels, strict=True):
        values = [float(modes[mode][key]) for mode in MODES]
        ax.bar([f"invariant {mode}" for mode in MODES], values, color=["tab:blue", "tab:orange"])
        for x, v in enumerate(values):
            ax.annotate(f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=9)
        ax.set_title(title)
    load = summary["load_average_1m"]
    fig.suptitle(
        f"SmolLM2-135M float32 CPU: batch-invariant mode on vs off (same run, load avg {load})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (step budget)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; best kept")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/invariance_cost"))
    args = parser.parse_args(argv)
    summary = run(args.prompt_tokens, args.chunk, args.steps, args.repeats, args.out, args.threads)
    print(json.dumps(summary["on_over_off"]))


if __name__ == "__main__":
    main()
