"""Engine `/metrics` → replica load, for our engine, vLLM and SGLang alike.

Each engine kind is a small table of metric names; the parser does not care which engine
wrote the text. Our engine uses vLLM's names on purpose, so it shares vLLM's row.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict


class EngineMetricNames(BaseModel):
    """Where one engine kind publishes the three numbers the autoscaler reads."""

    model_config = ConfigDict(frozen=True)

    waiting: str
    running: str
    kv_cache_usage: str
    kv_cache_is_percent: bool = False
    """True when the engine reports 0..100 instead of 0..1."""


VLLM_NAMES = EngineMetricNames(
    waiting="vllm:num_requests_waiting",
    running="vllm:num_requests_running",
    kv_cache_usage="vllm:kv_cache_usage_perc",
)
SGLANG_NAMES = EngineMetricNames(
    waiting="sglang:num_queue_reqs",
    running="sglang:num_running_reqs",
    kv_cache_usage="sglang:token_usage",
)
METRIC_NAMES: dict[str, EngineMetricNames] = {
    "servefleet": VLLM_NAMES,
    "vllm": VLLM_NAMES,
    "sglang": SGLANG_NAMES,
}


class EngineLoad(BaseModel):
    """The three numbers, summed over models served by the replica (usually one)."""

    model_config = ConfigDict(frozen=True)

    waiting: int
    running: int
    kv_cache_usage: float


class MetricsFormatError(ValueError):
    """The text is not Prometheus exposition format, or lacks the engine's series."""


def parse_engine_load(text: str, engine_kind: str, model_name: str | None = None) -> EngineLoad:
    """Read waiting/running/KV usage from exposition text.

    `model_name` keeps only series with that `model_name` label (several models behind one
    scrape); series without the label are always kept.
    """
    names = METRIC_NAMES.get(engine_kind)
    if names is None:
        raise ValueError(f"unknown engine kind {engine_kind!r}; known: {sorted(METRIC_NAMES)}")
    wanted = {names.waiting: 0.0, names.running: 0.0, names.kv_cache_usage: 0.0}
    seen: set[str] = set()
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise MetricsFormatError(f"not Prometheus text: {exc}") from exc
    for family in families:
        for sample in family.samples:
            if sample.name not in wanted:
                continue
            label = sample.labels.get("model_name")
            if model_name is not None and label is not None and label != model_name:
                continue
            seen.add(sample.name)
            if sample.name == names.kv_cache_usage:
                wanted[sample.name] = max(wanted[sample.name], sample.value)
            else:
                wanted[sample.name] += sample.value
    missing = sorted(set(wanted) - seen)
    if missing:
        raise MetricsFormatError(f"{engine_kind} metrics missing: {', '.join(missing)}")
    usage = wanted[names.kv_cache_usage]
    if names.kv_cache_is_percent:
        usage /= 100.0
    return EngineLoad(
        waiting=int(wanted[names.waiting]),
        running=int(wanted[names.running]),
        kv_cache_usage=min(1.0, max(0.0, usage)),
    )
