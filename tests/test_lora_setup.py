"""The engine's adapter registry as `servefleet engine --enable-lora` builds it: its limits
from the flags, and the dtype adapters are held in for the model's LoRA path."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from servefleet.engine.config import EngineConfig
from servefleet.engine.kernels.cpu_lora import CpuLoraKernel
from servefleet.engine.kv_events import KVEventLog
from servefleet.engine.lora.setup import adapter_dtype, build_lora_registry
from servefleet.engine.model.loader import LoadedModel


def _engine() -> SimpleNamespace:
    return SimpleNamespace(
        adapter_usage=SimpleNamespace(names=lambda: []), metrics=None, kv_events=KVEventLog()
    )


def test_the_registry_takes_its_limits_from_the_flags(smollm2: LoadedModel) -> None:
    config = EngineConfig(model="smollm2-135m-instruct", enable_lora=True, max_loras=3,
                          max_lora_memory="64MiB")  # fmt: skip
    engine = _engine()
    engine.metrics = SimpleNamespace(lora=None)
    registry = build_lora_registry(config, smollm2, engine)  # type: ignore[arg-type]
    assert registry.max_loras == 3
    assert registry.max_bytes == 64 << 20
    registry._changed()  # a change of the resident set wakes the KV event streams
    assert engine.kv_events.seq == 1


def test_adapters_are_bfloat16_under_the_c_kernel_else_the_models_dtype(
    smollm2: LoadedModel,
) -> None:
    model = smollm2.model
    kernel = model.lora_kernel
    assert isinstance(kernel, CpuLoraKernel)
    assert adapter_dtype(model) == torch.bfloat16
    model.set_lora_kernel(None)
    try:
        assert adapter_dtype(model) == torch.float32  # --matmul torch: PyTorch, float32
    finally:
        model.set_lora_kernel(kernel)
