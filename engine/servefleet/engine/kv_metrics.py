"""Prometheus series of KV transfers: blocks and bytes by direction and outcome, fallbacks."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from servefleet.api.kv_transfer import (
    BLOCKS_METRIC,
    BYTES_METRIC,
    DIRECTION_LABEL,
    FALLBACKS_METRIC,
    JOINED_METRIC,
    OUTCOME_LABEL,
    REASON_LABEL,
    SECONDS_METRIC,
    Direction,
    Outcome,
)


class KVTransferMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name", DIRECTION_LABEL, OUTCOME_LABEL]
        self.blocks = Counter(BLOCKS_METRIC, "KV blocks transferred.", labels, registry=registry)
        self.bytes = Counter(BYTES_METRIC, "KV bytes transferred.", labels, registry=registry)
        self.seconds = Histogram(
            SECONDS_METRIC,
            "Wall time of one KV transfer.",
            ["model_name", DIRECTION_LABEL],
            registry=registry,
        )
        self.fallbacks = Counter(
            FALLBACKS_METRIC,
            "Pulls that fell back to recomputing some or all blocks, by reason.",
            ["model_name", REASON_LABEL],
            registry=registry,
        )
        self.joined = Counter(
            JOINED_METRIC,
            "Pulls not made: another request was pulling the same run, and this one waited.",
            ["model_name"],
            registry=registry,
        )

    def transfer(
        self, direction: Direction, outcome: Outcome, blocks: int, nbytes: int, seconds: float
    ) -> None:
        labels = {"model_name": self.model_name, DIRECTION_LABEL: direction}
        self.blocks.labels(**labels, **{OUTCOME_LABEL: outcome}).inc(blocks)
        self.bytes.labels(**labels, **{OUTCOME_LABEL: outcome}).inc(nbytes)
        self.seconds.labels(**labels).observe(seconds)

    def join(self) -> None:
        self.joined.labels(model_name=self.model_name).inc()

    def fallback(self, reason: str) -> None:
        self.fallbacks.labels(model_name=self.model_name, **{REASON_LABEL: reason}).inc()
