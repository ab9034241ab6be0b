"""A SmolLM2 decode step, piece by piece, on the real weights: where the time goes.

For each row count (sequences in the step) this times, on the model as the engine loads
it: the 30 layers' projection matmuls through MKL, through the float32 C kernel and
through the packed 4-bit kernel (the GGUF's own Q4_1 blocks), the lm_head through the
float32 C kernel and the packed 8-bit kernel (Q8_0), and a whole decode step of the model
up to the final norm, lm_head excluded (every layer in one C call vs the per-layer Python
path), over a float32 and a float16 KV cache. Checks on the way that packed and float32
matmuls give the same bits, and that both step paths do. Medians over --repeats; one JSON
line, JSON + PNG to --out.

    uv run python bench/decode_step.py
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

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from servefleet.engine.attention import AttentionMetadata
from servefleet.engine.config import EngineConfig
from servefleet.engine.kernels.matmul import SmallRowsMatmul
from servefleet.engine.model.decoder_layer import DecoderLayer
from servefleet.engine.model.kv_layout import allocate_kv_cache
from servefleet.engine.model.llama import LlamaForCausalLM
from servefleet.engine.process import load_for

NAMES = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
CONTEXT = 256  # tokens of context per sequence in the step


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def matmul_parts(model: LlamaForCausalLM, rows: int, repeats: int) -> dict[str, float]:
    matmul = model.matmul
    assert isinstance(matmul, SmallRowsMatmul), "needs the C kernels (CPU with a compiler)"
    kernel = matmul.kernel
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    # The model holds the packed forms only; their float32 values for the dense kernels.
    weights = [(kernel.unpack(layer.packed[n]), layer.packed[n]) for layer in layers for n in NAMES]
    xs = {k: torch.randn(rows, k) for k in {w.shape[0] for w, _ in weights}}
    for w, p in weights[:4]:  # same bits, packed or not
        x = xs[w.shape[0]]
        assert torch.equal(kernel.packed_mm(x, p), kernel.mm(x, w))
    head, packed_head = model.embed_tokens, model.packed_lm_head
    assert packed_head is not None
    x = torch.randn(rows, head.shape[1])
    return {
        "layers_mkl_ms": median_ms(
            lambda: [torch.mm(xs[w.shape[0]], w) for w, _ in weights], repeats
        ),
        "layers_c_f32_ms": median_ms(
            lambda: [kernel.mm_unchecked(xs[w.shape[0]], w) for w, _ in weights], repeats
        ),
        "layers_c_packed_ms": median_ms(
            lambda: [kernel.packed_mm_unchecked(xs[w.shape[0]], p) for w, p in weights], repeats
        ),
        "lm_head_c_f32_ms": median_ms(lambda: kernel.linear_unchecked(x, head), repeats),
        "lm_head_c_packed_ms": median_ms(
            lambda: kernel.packed_mm_unchecked(x, packed_head), repeats
        ),
    }


def step_ms(
    model: LlamaForCausalLM, rows: int, kv_dtype: torch.dtype, repeats: int
) -> dict[str, float]:
    """A pure decode step of `rows` sequences with CONTEXT tokens each (cache contents random)."""
    config = model.config
    blocks_per_seq = CONTEXT // 16 + 1
    kv = allocate_kv_cache(config, rows * blocks_per_seq, 16, kv_dtype, "cpu")
    for k, v in kv:
        k.normal_()
        v.normal_()
    tables = torch.arange(rows * blocks_per_seq).view(rows, blocks_per_seq)
    pos = torch.full((rows,), CONTEXT)
    meta = AttentionMetadata(
        slot_mapping=tables[:, CONTEXT // 16] * 16 + CONTEXT % 16,
        block_size=16,
        num_decodes=rows,
        decode_block_tables=tables.int(),
        decode_context_lens=(pos + 1).int(),
    )
    ids = torch.randint(0, config.vocab_size, (rows,))
    out: dict[str, float] = {}
    results = {}
    for one_call in (True, False):
        model.one_call_decode = one_call

        def step() -> torch.Tensor:
            with torch.inference_mode():
                return model(ids, pos, kv, meta)

        results[one_call] = step()
        out["one_call" if one_call else "per_layer"] = median_ms(step, repeats)
    model.one_call_decode = True
    assert torch.equal(results[True], results[False]), "the two step paths must agree bitwise"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,4,8,16,32", help="sequences per decode step")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", type=Path, default=Path("bench/results/decode_step.json"))
    args = p.parse_args()
    model = load_for(EngineConfig(model="smollm2-135m-instruct")).model
    rows_list = [int(r) for r in args.rows.split(",")]
    per_rows: dict[int, dict[str, float]] = {}
    for rows in rows_list:
        parts = matmul_parts(model, rows, args.repeats)
        for name, dtype in (("f32_kv", torch.float32), ("f16_kv", torch.float16)):
            for path, ms in step_ms(model, rows, dtype, args.repeats).items():
                parts[f"step_{path}_{name}_ms"] = ms
        per_rows[rows] = {k: round(v, 3) for k, v in parts.items()}
        print(
            f"rows={rows}: " + ", ".join(f"{k}={v:.2f}" for k, v in per_rows[rows].items()),
            flush=True,
        )
    result = {
        "benchmark": "decode_step",
        "threads": torch.get_num_threads(),
        "context_tokens": CONTEXT,
        "per_rows": per_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(8, 5))
    for key in per_rows[rows_list[0]]:
        ax.plot(rows_list, [per_rows[r][key] for r in rows_list], marker="o", label=key)
    ax.set_xlabel("sequences in the decode step")
    ax.set_ylabel("ms (median)")
    ax.set_title("SmolLM2 decode step on this CPU")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
