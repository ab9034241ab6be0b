"""The Triton LoRA kernel (BGMV) on a GPU: checked against the PyTorch path and timed.

CPU tests run the same kernel source under Triton's interpreter (`tests/test_lora_triton.py`);
this runs it compiled on CUDA. Adapters are PEFT files of random weights read by the engine's
loader, rows take random adapters (some none) in no order. Checks: every projection of every
layer in float32, bfloat16 and float16 models, ranks 1-64, partial target sets. Timing: a
decode step's LoRA products (every layer and projection) through the kernel and through the
PyTorch path, for Llama-3-8B shapes (16 rows on 8 adapters, 64 rows on 32) and SmolLM2's.
Writes JSON.

    uv run python -m servefleet.bench.lora_gpu_check --out bench/results/lora_gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from servefleet.engine.kernels.triton_lora import TRITON_LORA
from servefleet.engine.lora.adapter import LoraAdapter, load_adapter
from servefleet.engine.lora.batch import PROJECTION_INDEX, LoraBatch
from servefleet.engine.model.config import ModelConfig

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODELS = {
    "tiny": ModelConfig(architecture="llama", vocab_size=64, hidden_size=40,
                        intermediate_size=72, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=12),
    "smollm2-135m": ModelConfig(architecture="llama", vocab_size=64, hidden_size=576,
                                intermediate_size=1536, num_layers=30, num_heads=9,
                                num_kv_heads=3, head_dim=64),
    "llama-3-8b": ModelConfig(architecture="llama", vocab_size=64, hidden_size=4096,
                              intermediate_size=14336, num_layers=32, num_heads=32,
                              num_kv_heads=8, head_dim=128),
}  # fmt: skip
CHECK_SPECS = [(8, ALL), (1, ("q_proj", "v_proj")), (33, ("gate_proj", "up_proj", "down_proj")),
               (4, ("k_proj", "o_proj")), (64, ("up_proj", "q_proj", "k_proj"))]  # fmt: skip


def _shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    h, i, q, kv = (
        c.hidden_size,
        c.intermediate_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
    )
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip


def _fused(c: ModelConfig) -> dict[str, tuple[int, int]]:
    h, i, q, kv = (
        c.hidden_size,
        c.intermediate_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
    )
    return {"qkv_weight": (h, q + 2 * kv), "o_weight": (q, h), "gate_up_weight": (h, 2 * i),
            "down_weight": (i, h)}  # fmt: skip


def adapters(root: Path, config: ModelConfig, specs: Sequence[tuple[int, Sequence[str]]],
             dtype: torch.dtype, device: str) -> list[LoraAdapter]:  # fmt: skip
    """PEFT files of random weights (deltas ~10% of their input) saved in `dtype`, read by the
    engine's loader."""
    loaded = []
    for index, (rank, targets) in enumerate(specs):
        g = torch.Generator().manual_seed(index)
        tensors = {}
        for layer in range(config.num_layers):
            for module in targets:
                fan_in, fan_out = _shapes(config)[module]
                kind = "self_attn" if module in ALL[:4] else "mlp"
                key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
                tensors[f"{key}.lora_A.weight"] = (
                    torch.randn(rank, fan_in, generator=g) / fan_in**0.5
                )
                tensors[f"{key}.lora_B.weight"] = (
                    torch.randn(fan_out, rank, generator=g) * 0.05 / rank**0.5
                )
        directory = root / f"{index}-{rank}"
        directory.mkdir(parents=True, exist_ok=True)
        if dtype != torch.float32:  # saved as a 16-bit adapter: half the file, same values
            tensors = {key: t.to(dtype) for key, t in tensors.items()}
        save_file(tensors, directory / "adapter_model.safetensors")
        body = {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets)}
        (directory / "adapter_config.json").write_text(json.dumps(body))
        loaded.append(load_adapter(f"a{index}", directory, config, 64, dtype, device))
    return loaded


def step(loras: Sequence[LoraAdapter], rows: int, seed: int, device: str) -> LoraBatch:
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(-1, len(loras), (rows,), generator=g).tolist()
    return LoraBatch.for_spans([(loras[a], r, 1) for r, a in enumerate(picks) if a >= 0], device)


def check(root: Path, device: str) -> dict[str, Any]:
    """Max |kernel - PyTorch| per model dtype, over every projection and layer, against the
    largest |output| (the PyTorch path rounds its products to 16 bits in 16-bit models)."""
    config, found = MODELS["tiny"], {}
    for name in ("float32", "bfloat16", "float16"):
        dtype = getattr(torch, name)
        loras = adapters(root / name, config, CHECK_SPECS, dtype, device)
        for rows in (1, 16, 77):
            batch = step(loras, rows, rows, device)
            worst, scale, taken = 0.0, 0.0, True
            for layer in range(config.num_layers):
                for proj, (k, n) in _fused(config).items():
                    x = torch.randn(rows, k, device=device, dtype=dtype)
                    base = torch.randn(rows, n, device=device, dtype=dtype)
                    want, got = base.clone(), base.clone()
                    batch.add(layer, proj, x, want)
                    kernel_step = batch.kernel_step(rows)
                    assert kernel_step is not None
                    taken &= TRITON_LORA.add(x, got, kernel_step, layer, PROJECTION_INDEX[proj])
                    worst = max(worst, float((got.float() - want.float()).abs().max()))
                    scale = max(scale, float(want.float().abs().max()))
            limit = (1e-5 if dtype == torch.float32 else 1e-2) * scale
            ok = taken and worst <= limit
            found[f"{name}-{rows}-rows"] = {
                "taken": taken, "max_abs_error": worst, "limit": limit, "ok": ok,
            }  # fmt: skip
    return found


def _ms(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


def timing(model: str, loras: Sequence[LoraAdapter], rows: int, device: str) -> dict[str, Any]:
    """ms for one decode step's LoRA products (every layer and projection), bfloat16."""
    config, count = MODELS[model], len(loras)
    spans = [(loras[r % count], r, 1) for r in range(rows)]
    spans.sort(key=lambda s: id(s[0]))  # the runner puts one adapter's decode rows together
    batch = LoraBatch.for_spans([(a, r, 1) for r, (a, _, _) in enumerate(spans)], device)
    inputs = {p: (torch.randn(rows, k, device=device, dtype=torch.bfloat16),
                  torch.zeros(rows, n, device=device, dtype=torch.bfloat16))
              for p, (k, n) in _fused(config).items()}  # fmt: skip

    def run(kernel: Any) -> None:
        for layer in range(config.num_layers):
            for proj, (x, out) in inputs.items():
                batch.add(layer, proj, x, out, kernel)

    triton_ms, torch_ms = _ms(lambda: run(TRITON_LORA)), _ms(lambda: run(None))
    weights = sum(a.nbytes for a in loras)
    return {"model": model, "rows": rows, "adapters": count, "rank": 16,
            "triton_ms": triton_ms, "torch_ms": torch_ms, "speedup": torch_ms / triton_ms,
            "adapter_bytes": weights, "triton_gb_per_s": weights / triton_ms / 1e6}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=Path("bench/results/lora_gpu_check.json"))
    p.add_argument("--skip-timing", action="store_true", help="checks only (e.g. interpreted)")
    args = p.parse_args(argv)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result: dict[str, Any] = {"benchmark": "lora_gpu_check", "gpu": gpu}
    with tempfile.TemporaryDirectory() as root:
        result["check"] = check(Path(root), args.device)
        result["timing"] = []
        for model, cases in (("smollm2-135m", [(16, 8)]), ("llama-3-8b", [(16, 8), (64, 32)])):
            if args.skip_timing:
                break
            most = max(count for _, count in cases)
            specs = [(16, ALL)] * most
            loras = adapters(Path(root) / model, MODELS[model], specs, torch.bfloat16, args.device)
            for rows, count in cases:
                result["timing"].append(timing(model, loras[:count], rows, args.device))
                print(json.dumps(result["timing"][-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if all(v["ok"] for v in result["check"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
