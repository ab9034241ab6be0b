"""Memory and decode speed of one model stored as float32, Q8_0, Q4_K and Q4_K_M GGUF,
and as float32 quantized at load (`--quantization int8`, `int4`: these read every page
of the memory-mapped float32 cache once, so their peak RSS counts it; `weight_bytes` is
what the model holds).

The same synthetic model (`quant_models`: random weights, nothing downloaded) is written in
each format and loaded the way `servefleet engine` loads it (`process.load_for`: packed
weights, C matmuls, fused ops, C attention), each in a fresh process so its RSS is its own.
Per format: weight bytes (float parameters, packed weights), RSS after a warm load (from the
conversion cache) and at its peak, and greedy decode tok/s at concurrency 1 and 16 on the
same prompts, all in one run, so the ratios are comparable.

The shape is SmolLM2's depth (30 layers), head size (64) and vocabulary (49152, tied), with
width 768 and FFN 2048: K-quants need input sizes that are multiples of 256, and SmolLM2's
576 is not (llama.cpp stores those tensors in a fallback format).

    uv run python -m servefleet.bench.quant_formats [--layers 30] \
        [--out bench/results/quant_formats]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from servefleet.bench.quant_models import SCHEMES, LlamaShape, write_llama_gguf

FORMATS = ("F32", "Q8_0", "Q4_K", "Q4_K_M")
# Rows that load the float32 file quantized at load: row name -> --quantization.
LOAD_QUANTIZED = {"F32+int8": "int8", "F32+int4": "int4"}
PROMPT_TOKENS = 64
STEPS = {1: 64, 16: 32}  # decode steps timed, by concurrency
BLOCK = 16


def shape_for(layers: int) -> LlamaShape:
    return LlamaShape(hidden=768, heads=12, kv_heads=4, ffn=2048, layers=layers, vocab=49152)


def _rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process, MB (Linux)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1e3, int(fields["VmHWM"].split()[0]) / 1e3


def measure(path: Path, quantization: str | None = None) -> dict[str, object]:
    """Load `path` as the engine does and time greedy decoding (run in a child process)."""
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    import torch

    from servefleet.engine.config import EngineConfig
    from servefleet.engine.process import load_for

    t0 = time.perf_counter()
    loaded = load_for(
        EngineConfig.model_validate({"model": str(path), "quantization": quantization})
    )
    load_s = time.perf_counter() - t0
    rss_loaded, _ = _rss_mb()
    result: dict[str, object] = {
        "load_s": round(load_s, 2),
        "weight_bytes": loaded.model.weight_bytes(),
        "rss_after_load_mb": round(rss_loaded, 1),
    }
    with torch.inference_mode():
        for concurrency, steps in STEPS.items():
            seconds = decode_seconds(loaded.model, concurrency, steps)
            result[f"decode_tok_s_c{concurrency}"] = round(concurrency * steps / seconds, 2)
    result["rss_peak_mb"] = round(_rss_mb()[1], 1)
    return result


def decode_seconds(model: object, concurrency: int, steps: int, kv_dtype: str = "float32") -> float:
    """Prefill `concurrency` prompts, then time `steps` batched greedy decode steps
    (over a paged KV cache of `kv_dtype`, a torch dtype name)."""
    import torch

    from servefleet.engine.attention import AttentionMetadata, PrefillSpan
    from servefleet.engine.model.kv_layout import allocate_kv_cache
    from servefleet.engine.model.llama import LlamaForCausalLM

    assert isinstance(model, LlamaForCausalLM)
    per_seq = -(-(PROMPT_TOKENS + steps) // BLOCK)
    dtype = getattr(torch, kv_dtype)
    kv = allocate_kv_cache(model.config, concurrency * per_seq, BLOCK, dtype, "cpu")
    tables = torch.arange(concurrency * per_seq).view(concurrency, per_seq)
    generator = torch.Generator().manual_seed(0)  # the same prompts for every format
    prompts = torch.randint(
        3, model.config.vocab_size, (concurrency, PROMPT_TOKENS), generator=generator
    )

    def slots(row: int, positions: torch.Tensor) -> torch.Tensor:
        return tables[row][positions // BLOCK] * BLOCK + positions % BLOCK

    last = []
    for row in range(concurrency):
        positions = torch.arange(PROMPT_TOKENS)
        span = PrefillSpan(0, PROMPT_TOKENS, 0, tables[row, : -(-PROMPT_TOKENS // BLOCK)])
        meta = AttentionMetadata(slots(row, positions), BLOCK, prefills=[span])
        hidden = model(prompts[row], positions, kv, meta)
        last.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    tokens = torch.tensor(last)
    start = time.perf_counter()
    for step in range(steps):
        position = PROMPT_TOKENS + step
        positions = torch.full((concurrency,), position)
        context = position + 1
        meta = AttentionMetadata(
            slot_mapping=torch.cat([slots(r, positions[r : r + 1]) for r in range(concurrency)]),
            block_size=BLOCK,
            num_decodes=concurrency,
            decode_block_tables=tables[:, : -(-context // BLOCK)].int().contiguous(),
            decode_context_lens=torch.full((concurrency,), context, dtype=torch.int32),
        )
        tokens = model.compute_logits(model(tokens, positions, kv, meta)).argmax(-1)
    return time.perf_counter() - start


def run_child(path: Path, cache: Path, quantization: str | None = None) -> dict[str, object]:
    env = {**os.environ, "SERVEFLEET_CACHE_DIR": str(cache)}
    command = [sys.executable, "-m", "servefleet.bench.quant_formats", "--measure", str(path)]
    command += ["--quantization", quantization] if quantization else []
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {path.name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(layers: int, out: Path) -> dict[str, object]:
    shape = shape_for(layers)
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="quant-formats-") as tmp:
        for name in FORMATS:
            path = Path(tmp) / f"model-{name}.gguf"
            write_llama_gguf(path, shape, SCHEMES[name], np.random.default_rng(0))
            cache = Path(tmp) / "cache"
            cold = run_child(path, cache)  # converts into the cache
            results[name] = {
                **run_child(path, cache),  # a warm start, as every start but the first
                "file_mb": round(path.stat().st_size / 1e6, 1),
                "cold_load_s": cold["load_s"],
            }
            if name == "F32":  # the same warm float32 file, quantized at every start
                for row, quantization in LOAD_QUANTIZED.items():
                    results[row] = run_child(path, cache, quantization)
            path.unlink()
    base = results["F32"]
    summary = {
        "shape": shape.__dict__,
        "prompt_tokens": PROMPT_TOKENS,
        "decode_steps": {str(c): s for c, s in STEPS.items()},
        "formats": results,
        "vs_float32": {
            name: {
                "rss_after_load": round(_ratio(r, base, "rss_after_load_mb"), 3),
                "decode_c1": round(_ratio(r, base, "decode_tok_s_c1"), 3),
                "decode_c16": round(_ratio(r, base, "decode_tok_s_c16"), 3),
            }
            for name, r in results.items()
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_formats.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(results, out / "quant_formats.png")
    return summary


def _ratio(result: dict[str, object], base: dict[str, object], key: str) -> float:
    return float(result[key]) / float(base[key])  # type: ignore[arg-type]


def plot(results: dict[str, dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [
        ("RSS after load (MB)", ["rss_after_load_mb", "rss_peak_mb"], ["after load", "peak"]),
        ("decode tok/s, c=1", ["decode_tok_s_c1"], None),
        ("decode tok/s, c=16", ["decode_tok_s_c16"], None),
    ]
    for ax, (title, keys, labels) in zip(axes, panels, strict=True):
        width = 0.8 / len(keys)
        for i, key in enumerate(keys):
            values = [float(results[n][key]) for n in names]  # type: ignore[arg-type]
            xs = [x + i * width for x in range(len(names))]
            ax.bar(xs, values, width, label=None if labels is None else labels[i])
            for x, v in zip(xs, values, strict=True):
                ax.annotate(f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=8)
        ax.set_xticks([x + width * (len(keys) - 1) / 2 for x in range(len(names))], names)
        ax.set_title(title)
        if labels:
            ax.legend()
    fig.suptitle("one model: GGUF formats and float32 quantized at load (same prompts, same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("bench/results/quant_formats"))
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child's job
    parser.add_argument("--quantization", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.quantization)))
        return
    print(json.dumps(run(args.layers, args.out)["vs_float32"]))


if __name__ == "__main__":
    main()
