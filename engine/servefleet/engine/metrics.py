"""Prometheus metrics, under vLLM's names where routers and autoscalers read them.

Each engine owns its registry (no process-global state), so several engines can
live in one test process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from servefleet.api.kv_cache import KV_CACHE_BYTES_PER_TOKEN_METRIC, KV_CACHE_DTYPE_LABEL
from servefleet.api.step_cost import (
    DECODE_STEP_TARGET_METRIC,
    PROMPT_CHUNK_METRIC,
    STEP_COST_METRIC,
    STEP_COST_TERM_LABEL,
    STEP_COST_TERMS,
)
from servefleet.engine.chargeback import EngineChargeback
from servefleet.engine.kv_metrics import KVTransferMetrics
from servefleet.engine.lora.metrics import LoraMetrics

if TYPE_CHECKING:
    from servefleet.engine.chunk_budget import ChunkBudget
    from servefleet.engine.spec.stats import SpecDecodeStats
    from servefleet.engine.step_cost import StepCostModel

LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name

        # Series are labelled once here; callers use the children directly.
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name=model_name)

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS
        ) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets).labels(
                model_name=model_name
            )

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name=model_name)

        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to run.")
        self.num_requests_running = gauge("vllm:num_requests_running", "Requests running.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the cache.")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.")
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first step.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted.")
        self.step_seconds = histogram("servefleet_engine_step_seconds", "Wall time of a step.")
        self.step_tokens = histogram(
            "servefleet_engine_step_tokens",
            "Tokens in one engine step.",
            (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
        )
        # The step-cost model (`step_cost`) and the prompt chunk it chose beside decodes.
        self.step_cost = Gauge(
            STEP_COST_METRIC,
            "Fitted step cost: seconds per unit of each term of the step-cost model.",
            [*labels, STEP_COST_TERM_LABEL],
            registry=r,
        )
        self.prompt_chunk_tokens = gauge(
            PROMPT_CHUNK_METRIC, "Prompt tokens of the last step with decodes running."
        )
        self.decode_step_target = gauge(
            DECODE_STEP_TARGET_METRIC,
            "Step-time target of the last step with decodes running (0: no target).",
        )
        self.requests_finished = Counter(
            "servefleet_engine_requests_finished",
            "Finished requests by reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.requests_rejected = Counter(
            "servefleet_engine_requests_rejected",
            "Requests refused before running, by HTTP status.",
            [*labels, "status"],
            registry=r,
        )
        self.kv_blocks_total = gauge("servefleet_engine_kv_cache_blocks", "KV-cache blocks.")
        # Blocks x block size x this = the cache's bytes; its label says how tokens are stored.
        self.kv_bytes_per_token = Gauge(
            KV_CACHE_BYTES_PER_TOKEN_METRIC,
            "KV-cache bytes per token over all layers (keys, values, int8 scales), by dtype.",
            [*labels, KV_CACHE_DTYPE_LABEL],
            registry=r,
        )
        self.cold_start = gauge(
            "servefleet_engine_cold_start_seconds", "Process start to ready, in seconds."
        )
        self.draining = gauge("servefleet_engine_draining", "1 while draining after SIGTERM.")
        # Speculative decoding, vLLM's names: acceptance rate = accepted / draft tokens,
        # mean accepted length = 1 + accepted / drafts.
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Verified proposals.")
        self.spec_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Proposed tokens verified."
        )
        self.spec_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted."
        )
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by position in the proposal (0-based).",
            [*labels, "position"],
            registry=r,
        )
        self.lora = LoraMetrics(r, model_name)
        self.kv_transfer = KVTransferMetrics(r, model_name)
        self.chargeback = EngineChargeback(r, model_name)  # `servefleet.api.chargeback`

    def set_kv_cache_layout(self, cache_dtype: str, bytes_per_token: int) -> None:
        self.kv_bytes_per_token.labels(
            **{"model_name": self.model_name, KV_CACHE_DTYPE_LABEL: cache_dtype}
        ).set(bytes_per_token)

    def export_step_cost(self, model: StepCostModel, budget: ChunkBudget | None) -> None:
        """The model's coefficients and, with a decode-step target, the chunk it chose."""

        def coefficient(term: str) -> Callable[[], float]:
            return lambda: model.coefficients[term]

        for term in STEP_COST_TERMS:
            child = self.step_cost.labels(
                **{"model_name": self.model_name, STEP_COST_TERM_LABEL: term}
            )
            child.set_function(coefficient(term))
        if budget is not None:
            self.prompt_chunk_tokens.set_function(lambda: budget.last_chunk_tokens)
            self.decode_step_target.set_function(lambda: budget.last_target_seconds)

    def finished(self, reason: str) -> None:
        self.requests_finished.labels(model_name=self.model_name, finished_reason=reason).inc()

    def rejected(self, status: int) -> None:
        self.requests_rejected.labels(model_name=self.model_name, status=str(status)).inc()

    def record_spec_decode(self, stats: SpecDecodeStats) -> None:
        if not stats.num_drafts:
            return
        self.spec_drafts.inc(stats.num_drafts)
        self.spec_draft_tokens.inc(stats.num_draft_tokens)
        self.spec_accepted_tokens.inc(stats.num_accepted_tokens)
        for position, count in stats.accepted_per_position.items():
            self.spec_accepted_per_pos.labels(
                model_name=self.model_name, position=str(position)
            ).inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
