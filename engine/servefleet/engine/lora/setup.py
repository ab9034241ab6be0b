"""The engine's adapter registry, built from its flags (`--enable-lora`, `--max-loras`,
`--max-lora-rank`) around the loaded model."""

from __future__ import annotations

from pathlib import Path

import torch

from servefleet.engine.config import EngineConfig
from servefleet.engine.kernels.cpu_lora import CpuLoraKernel
from servefleet.engine.loop import Engine
from servefleet.engine.lora.adapter import LoraAdapter, load_adapter
from servefleet.engine.lora.registry import LoraRegistry
from servefleet.engine.model.llama import LlamaForCausalLM
from servefleet.engine.model.loader import LoadedModel


def adapter_dtype(model: LlamaForCausalLM) -> torch.dtype:
    """What adapters are held in: bfloat16 where the C LoRA kernel runs them (a float32 CPU
    model with the C matmuls), since a decode step streams every adapter in it once and
    bfloat16 halves those bytes — each weight rounded once at load, far below the noise of
    the quantized base weights; the products stay float32. Elsewhere the model's dtype (as
    vLLM's `--lora-dtype auto`), so `--matmul torch` keeps float32 adapters."""
    dtype = model.norm.dtype
    if isinstance(model.lora_kernel, CpuLoraKernel) and dtype == torch.float32:
        return torch.bfloat16
    return dtype


def build_lora_registry(config: EngineConfig, loaded: LoadedModel, engine: Engine) -> LoraRegistry:
    """Adapters laid out for the model's LoRA path and on its device; the engine's sequences
    say which may not be evicted; every change of the resident set is published on the KV
    event stream (`KVEventLog.mark`)."""
    dtype, device = adapter_dtype(loaded.model), loaded.model.norm.device

    def loader(name: str, directory: Path) -> LoraAdapter:
        return load_adapter(name, directory, loaded.config, config.max_lora_rank, dtype, device)

    return LoraRegistry(
        config.max_loras,
        loader,
        engine.adapter_usage.names,
        engine.metrics.lora,
        max_bytes=config.lora_memory_bytes,
        on_change=engine.kv_events.mark,
    )
