"""The adapter series: how many are loaded, loads, evictions, load time, and requests and
generated tokens per adapter (names from `servefleet.api.lora`)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from servefleet.api.lora import (
    LORA_ADAPTER_LABEL,
    LORA_ADAPTERS_LOADED_METRIC,
    LORA_EVICTIONS_METRIC,
    LORA_LOAD_SECONDS_METRIC,
    LORA_LOADS_METRIC,
    LORA_REQUESTS_METRIC,
    LORA_TOKENS_METRIC,
)

LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class LoraMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.model_name = model_name
        self.loaded = Gauge(
            LORA_ADAPTERS_LOADED_METRIC, "LoRA adapters resident.", labels, registry=registry
        ).labels(model_name=model_name)
        self.loads = Counter(
            LORA_LOADS_METRIC, "LoRA adapters loaded.", labels, registry=registry
        ).labels(model_name=model_name)
        self.evictions = Counter(
            LORA_EVICTIONS_METRIC, "LoRA adapters evicted (LRU).", labels, registry=registry
        ).labels(model_name=model_name)
        self.load_seconds = Histogram(
            LORA_LOAD_SECONDS_METRIC,
            "Time to read and lay out one adapter.",
            labels,
            registry=registry,
            buckets=LOAD_BUCKETS,
        ).labels(model_name=model_name)
        per_adapter = [*labels, LORA_ADAPTER_LABEL]
        self._requests = Counter(
            LORA_REQUESTS_METRIC, "Requests per adapter.", per_adapter, registry=registry
        )
        self._tokens = Counter(
            LORA_TOKENS_METRIC, "Tokens generated per adapter.", per_adapter, registry=registry
        )

    def track_loaded(self, count: Callable[[], int]) -> None:
        self.loaded.set_function(lambda: float(count()))

    def request(self, adapter: str) -> None:
        self._requests.labels(self.model_name, adapter).inc()

    def tokens(self, adapter: str, count: int) -> None:
        self._tokens.labels(self.model_name, adapter).inc(count)
