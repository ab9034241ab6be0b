"""Engine `/metrics` → replica load, for our engine, vLLM and SGLang alike.

The metric names come from the engine adapters in `servefleet.api.engines` (the table the
operator renders pods from); the parser does not care which engine wrote the text.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict

from servefleet.api.engines import engine_adapter


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
    names = engine_adapter(engine_kind).metrics
    wanted = {names.requests_waiting: 0.0, names.requests_running: 0.0, names.kv_cache_usage: 0.0}
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
        waiting=int(wanted[names.requests_waiting]),
        running=int(wanted[names.requests_running]),
        kv_cache_usage=min(1.0, max(0.0, usage)),
    )
