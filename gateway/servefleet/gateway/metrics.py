"""Prometheus metrics of one gateway, in its own registry (no process-wide state).

Label children are cached per (tenant, model) so the request path does one dict lookup, not a
label resolution per metric.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OUTCOMES = ("ok", "4xx", "429", "503", "spilled", "upstream_error")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(slots=True)
class TenantModelMetrics:
    """The children one request touches, resolved once per (tenant, model)."""

    outcome: dict[str, Counter]
    prompt_tokens: Counter
    completion_tokens: Counter
    queue_wait: Histogram
    ttft: Histogram


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "servefleet_gateway_requests",
            "Requests by outcome (ok, 4xx, 429, 503, spilled, upstream_error).",
            ["tenant", "model", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "servefleet_gateway_prompt_tokens",
            "Prompt tokens served.",
            ["tenant", "model"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "servefleet_gateway_completion_tokens",
            "Completion tokens served.",
            ["tenant", "model"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "servefleet_gateway_queue_wait_seconds",
            "Time spent in the gateway queue.",
            ["tenant", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "servefleet_gateway_ttft_seconds",
            "Time from request arrival to the first response byte sent, at the gateway.",
            ["tenant", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "servefleet_gateway_queue_depth",
            "Requests waiting in the gateway queue.",
            ["model", "traffic_class"],
            registry=r,
        )
        self.in_flight = Gauge(
            "servefleet_gateway_in_flight",
            "Requests dispatched and not finished.",
            ["model"],
            registry=r,
        )
        self.replica_outstanding = Gauge(
            "servefleet_gateway_replica_outstanding",
            "Outstanding requests per replica.",
            ["model", "replica"],
            registry=r,
        )
        self.replicas_ready = Gauge(
            "servefleet_gateway_replicas_ready",
            "Routable replicas.",
            ["model"],
            registry=r,
        )
        self.spillovers = Counter(
            "servefleet_gateway_spillovers",
            "Requests sent to the hosted API, by reason.",
            ["model", "reason"],
            registry=r,
        )
        self.redis_errors = Counter(
            "servefleet_gateway_redis_errors",
            "Failed Redis operations (limits fell back to per-replica).",
            ["operation"],
            registry=r,
        )
        self.limits_degraded = Gauge(
            "servefleet_gateway_limits_degraded",
            "1 while limits are enforced per replica because Redis is unreachable.",
            registry=r,
        )
        self.upstream_retries = Counter(
            "servefleet_gateway_upstream_retries",
            "Requests retried on another replica.",
            ["model"],
            registry=r,
        )
        self.ejections = Counter(
            "servefleet_gateway_replica_ejections",
            "Replicas ejected after a failure.",
            ["model"],
            registry=r,
        )
        self._children: dict[tuple[str, str], TenantModelMetrics] = {}

    def for_tenant(self, tenant: str, model: str) -> TenantModelMetrics:
        key = (tenant, model)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = TenantModelMetrics(
                {o: self.requests.labels(tenant, model, o) for o in OUTCOMES},
                self.prompt_tokens.labels(tenant, model),
                self.completion_tokens.labels(tenant, model),
                self.queue_wait.labels(tenant, model),
                self.ttft.labels(tenant, model),
            )
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
