"""Prometheus metrics of one gateway, in its own registry (no process-wide state).

Label children are cached per (tenant, model) so the request path does one dict lookup, not a
label resolution per metric. Tenant series are capped: the first `tenant_series_limit` tenants
seen keep their own label value and every later one is summed in `tenant="_other"` (no tenant
name can contain "_"), so thousands of tenants cost Prometheus a bounded number of series; the
access log still names every tenant. Pool gauges carry `deployment` as well as `model`, so
alerts can join them with the autoscaler's series. The `outcome` label takes the values of
`servefleet.api.outcomes.Outcome`, every one created up front (a rate is 0, not absent).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from servefleet.api import chargeback as cb
from servefleet.api.budgets import BUDGET_USED_RATIO_METRIC
from servefleet.api.chargeback import OTHER_TENANT
from servefleet.api.gateway_stats import DeploymentStats
from servefleet.api.outcomes import Outcome

PREFIX = "servefleet_gateway_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
DEFAULT_TENANT_SERIES_LIMIT = 100


@dataclass(slots=True)
class TenantModelMetrics:
    """The children one request touches, resolved once per (tenant, model)."""

    outcome: dict[Outcome, Counter]
    prompt_tokens: Counter
    completion_tokens: Counter
    queue_wait: Histogram
    ttft: Histogram
    spilled_prompt_tokens: Counter  # sent to the hosted API (`servefleet.api.chargeback`)
    spilled_completion_tokens: Counter


class GatewayMetrics:
    def __init__(self, tenant_series_limit: int = DEFAULT_TENANT_SERIES_LIMIT) -> None:
        self.registry = CollectorRegistry()
        self.tenant_series_limit = tenant_series_limit
        self._labelled_tenants: set[str] = set()
        tm = ["tenant", "model"]
        self.requests = self._counter(
            "requests",
            f"Requests by outcome ({', '.join(Outcome)}).",
            [*tm, "outcome"],
        )
        self.prompt_tokens = Counter(
            cb.GATEWAY_PROMPT_TOKENS, "Prompt tokens served.", tm, registry=self.registry
        )
        self.completion_tokens = Counter(
            cb.GATEWAY_COMPLETION_TOKENS, "Completion tokens served.", tm, registry=self.registry
        )
        self.spilled_tokens = Counter(
            cb.GATEWAY_SPILLED_TOKENS,
            "Tokens of requests answered by the hosted API, by kind (prompt, completion).",
            [*tm, cb.KIND_LABEL],
            registry=self.registry,
        )
        self.queue_wait = self._histogram(
            "queue_wait_seconds", "Time spent in the gateway queue.", tm
        )
        self.ttft = self._histogram(
            "ttft_seconds",
            "Time from request arrival to the first response byte sent, at the gateway.",
            tm,
        )
        self.queue_depth = self._gauge(
            "queue_depth",
            "Requests waiting in the gateway queue.",
            ["deployment", "model", "traffic_class"],
        )
        self.in_flight = self._gauge(
            "in_flight", "Requests dispatched and not finished.", ["deployment", "model"]
        )
        self.replica_outstanding = self._gauge(
            "replica_outstanding",
            "Outstanding requests per replica.",
            ["deployment", "model", "replica"],
        )
        self.replicas_ready = self._gauge(
            "replicas_ready", "Routable replicas.", ["deployment", "model"]
        )
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
        self.stream_continuations = self._counter(
            "stream_continuations",
            "Streams continued on another replica after theirs broke mid-stream.",
            ["model"],
        )
        self.ejections = self._counter(
            "replica_ejections", "Replicas ejected after a failure.", ["model"]
        )
        self.budget_used_ratio = Gauge(
            BUDGET_USED_RATIO_METRIC,
            "Share of a tenant's budget used this period (its tightest scope), as this "
            "replica last saw it when the tenant reserved.",
            ["tenant", "period", "unit"],
            registry=self.registry,
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

    def tenant_label(self, tenant: str) -> str:
        """The tenant's own name while under the cap (it keeps it for life), else "_other"."""
        if tenant in self._labelled_tenants:
            return tenant
        if len(self._labelled_tenants) < self.tenant_series_limit:
            self._labelled_tenants.add(tenant)
            return tenant
        return OTHER_TENANT

    def for_tenant(self, tenant: str, model: str) -> TenantModelMetrics:
        key = (self.tenant_label(tenant), model)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = TenantModelMetrics(
                {o: self.requests.labels(key[0], model, o.value) for o in Outcome},
                self.prompt_tokens.labels(*key),
                self.completion_tokens.labels(*key),
                self.queue_wait.labels(*key),
                self.ttft.labels(*key),
                self.spilled_tokens.labels(*key, cb.PROMPT),
                self.spilled_tokens.labels(*key, cb.COMPLETION),
            )
        return found

    def set_pool_gauges(self, stats: DeploymentStats) -> None:
        """Gauges are read from the pools at scrape time instead of being kept per request."""
        pool = (stats.name, stats.model)
        self.queue_depth.labels(*pool, "interactive").set(stats.queue_depth_interactive)
        self.queue_depth.labels(*pool, "batch").set(stats.queue_depth_batch)
        self.in_flight.labels(*pool).set(stats.in_flight)
        self.replicas_ready.labels(*pool).set(stats.ready_replicas)
        for replica in stats.replicas:
            self.replica_outstanding.labels(*pool, replica.endpoint).set(replica.outstanding)

    def forget_pool(self, stats: DeploymentStats) -> None:
        """A removed deployment's gauges must not be scraped forever at their last value."""
        pool = (stats.name, stats.model)
        series = [
            *((self.queue_depth, (*pool, c)) for c in ("interactive", "batch")),
            (self.in_flight, pool),
            (self.replicas_ready, pool),
            *((self.replica_outstanding, (*pool, r.endpoint)) for r in stats.replicas),
        ]
        for gauge, labels in series:
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)
