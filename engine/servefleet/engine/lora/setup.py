"""The engine's adapter registry, built from its flags (`--enable-lora`, `--max-loras`,
`--max-lora-rank`) around the loaded model."""

from __future__ import annotations

from pathlib import Path

from servefleet.engine.config import EngineConfig
from servefleet.engine.loop import Engine
from servefleet.engine.lora.adapter import LoraAdapter, load_adapter
from servefleet.engine.lora.registry import LoraRegistry
from servefleet.engine.model.loader import LoadedModel


def build_lora_registry(config: EngineConfig, loaded: LoadedModel, engine: Engine) -> LoraRegistry:
    """Adapters laid out in the model's dtype and on its device; the engine's sequences say
    which may not be evicted."""
    weights = loaded.model.norm

    def loader(name: str, directory: Path) -> LoraAdapter:
        return load_adapter(
            name, directory, loaded.config, config.max_lora_rank, weights.dtype, weights.device
        )

    return LoraRegistry(config.max_loras, loader, engine.adapter_usage.names, engine.metrics.lora)
