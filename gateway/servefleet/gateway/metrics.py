"""Prometheus metrics of one gateway, in its own registry (no process-wide state).

Label children are cached per (tenant, model) so the request path does one dict lookup, not a
label resolution per metric.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from servefleet.api.gateway_stats import DeploymentStats

PREFIX = "servefleet_gateway_"
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
        tm = ["tenant", "model"]
        self.requests = self._counter(
            "requests",
            "Requests by outcome (ok, 4xx, 429, 503, spilled, upstream_error).",
            [*tm, "outcome"],
        )
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens served.", tm)
        self.completion_tokens = self._counter("completion_tokens", "Completion tokens served.", tm)
        self.queue_wait = self._histogram(
            "queue_wait_seconds", "Time spent in the gateway queue.", tm
        )
        self.ttft = self._histogram(
            "ttft_seconds",
            "Time from request arrival to the first response byte sent, at the gateway.",
            tm,
        )
        self.queue_depth = self._gauge(
            "queue_depth", "Requests waiting in the gateway queue.", ["model", "traffic_class"]
        )
        self.in_flight = self._gauge(
            "in_flight", "Requests dispatched and not finished.", ["model"]
        )
        self.replica_outstanding = self._gauge(
            "replica_outstanding", "Outstanding requests per replica.", ["model", "replica"]
        )
        self.replicas_ready = self._gauge("replicas_ready", "Routable replicas.", ["model"])
        self.spillovers = self._counter(
            "spillovers", "Requests sent to the hosted API, by reason.", ["model", "reason"]
        )
        self.redis_errors = self._counter(
            "redis_errors",
            "Failed Redis operations (limits fell back to per-replica).",
            ["operation"],
        )
        self.limits_degraded = self._gauge(
            "limits_degraded",
            "1 while limits are enforced per replica because Redis is unreachable.",
            [],
        )
        self.upstream_retries = self._counter(
            "upstream_retries", "Requests retried on another replica.", ["model"]
        )
        self.ejections = self._counter(
            "replica_ejections", "Replicas ejected after a failure.", ["model"]
        )
        self._children: dict[tuple[str, str], TenantModelMetrics] = {}

    def _counter(self, name: str, doc: str, labels: list[str]) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: list[str]) -> Gauge:
        return Gauge(PREFIX + name, doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, labels: list[str]) -> Histogram:
        return Histogram(
            PREFIX + name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry
        )

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

    def set_pool_gauges(self, stats: DeploymentStats) -> None:
        """Gauges are read from the pools at scrape time instead of being kept per request."""
        model = stats.model
        self.queue_depth.labels(model, "interactive").set(stats.queue_depth_interactive)
        self.queue_depth.labels(model, "batch").set(stats.queue_depth_batch)
        self.in_flight.labels(model).set(stats.in_flight)
        self.replicas_ready.labels(model).set(stats.ready_replicas)
        for replica in stats.replicas:
            self.replica_outstanding.labels(model, replica.endpoint).set(replica.outstanding)

    def forget_pool(self, stats: DeploymentStats) -> None:
        """A removed deployment's gauges must not be scraped forever at their last value."""
        model = stats.model
        series = [
            *((self.queue_depth, (model, c)) for c in ("interactive", "batch")),
            (self.in_flight, (model,)),
            (self.replicas_ready, (model,)),
            *((self.replica_outstanding, (model, r.endpoint)) for r in stats.replicas),
        ]
        for gauge, labels in series:
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)
