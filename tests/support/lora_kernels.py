"""Adapters and steps for the LoRA kernel tests: real PEFT files (safetensors + config) of
random A and B for a model config, read by the engine's loader, and a step whose rows take
adapters in a shuffled order (with rows on the base model between them)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from servefleet.engine.lora.adapter import LoraAdapter, load_adapter
from servefleet.engine.lora.batch import LoraBatch
from servefleet.engine.model.config import ModelConfig

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# No width a multiple of the vector width: every masked tail of the kernels runs.
TINY = ModelConfig(
    architecture="llama", vocab_size=64, hidden_size=40, intermediate_size=72, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=12,
)  # fmt: skip


def shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of the HF projections."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip


def fused_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of our fused projections."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"qkv_weight": (h, q + 2 * kv), "o_weight": (q, h), "gate_up_weight": (h, 2 * i),
            "down_weight": (i, h)}  # fmt: skip


def write_adapter(
    directory: Path,
    config: ModelConfig,
    seed: int,
    rank: int,
    targets: Sequence[str] = ALL,
    scale: float = 0.05,
) -> Path:
    """A PEFT adapter directory with random weights (lora_alpha = 2r: scaling 2), sized so a
    delta is about `2 · scale` of its input's norm (a model stays in its working range)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            fan_in, fan_out = shapes(config)[module]
            kind = "self_attn" if module in ALL[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            a = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=generator) * (scale / rank**0.5)
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    body = {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets)}
    (directory / "adapter_config.json").write_text(json.dumps(body))
    return directory


def make_adapters(
    root: Path,
    config: ModelConfig,
    specs: Sequence[tuple[int, Sequence[str]]],
    dtype: torch.dtype = torch.float32,
) -> list[LoraAdapter]:
    """One adapter per (rank, targets), loaded by the engine's loader in `dtype`."""
    loaded = []
    for i, (rank, targets) in enumerate(specs):
        directory = write_adapter(root / f"a{i}-{rank}", config, i, rank, targets)
        loaded.append(load_adapter(f"a{i}", directory, config, max_rank=64, dtype=dtype))
    return loaded


def shuffled_step(
    adapters: Sequence[LoraAdapter], rows: int, seed: int, base_share: float = 0.25
) -> tuple[LoraBatch, list[int]]:
    """A step of `rows` rows, each on a random adapter (or, for about `base_share` of them,
    on none), in no particular order; returns the batch and each row's adapter index (-1)."""
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(adapters), (rows,), generator=generator).tolist()
    base = (torch.rand(rows, generator=generator) < base_share).tolist()
    which = [-1 if b else p for p, b in zip(picks, base, strict=True)]
    spans = [(adapters[a], row, 1) for row, a in enumerate(which) if a >= 0]
    return LoraBatch.for_spans(spans, "cpu"), which
