"""Every decision as Prometheus series: desired, current, and why."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from .policy import Decision, Reason


class AutoscalerMetrics:
    """Owns its registry, so several autoscalers (tests, local mode) never collide."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["deployment"]
        self.desired = Gauge(
            "servefleet_autoscaler_desired_replicas",
            "Replicas the last decision asked for.",
            labels,
            registry=self.registry,
        )
        self.current = Gauge(
            "servefleet_autoscaler_current_replicas",
            "Ready plus starting replicas when the decision was taken.",
            labels,
            registry=self.registry,
        )
        self.demand = Gauge(
            "servefleet_autoscaler_demand",
            "Requests queued in the gateway plus in flight on replicas.",
            labels,
            registry=self.registry,
        )
        self.reason = Gauge(
            "servefleet_autoscaler_reason",
            "1 for the reason of the last decision, 0 for the others.",
            [*labels, "reason"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "servefleet_autoscaler_decisions",
            "Decisions taken, by reason.",
            [*labels, "reason"],
            registry=self.registry,
        )
        self.cold_start = Gauge(
            "servefleet_autoscaler_cold_start_seconds",
            "Measured (smoothed) time from replica start to ready.",
            labels,
            registry=self.registry,
        )
        self.max_replicas = Gauge(
            "servefleet_autoscaler_max_replicas",
            "The deployment's maxReplicas (alerts compare the pool's size with it).",
            labels,
            registry=self.registry,
        )
        self.prefill_desired = Gauge(
            "servefleet_autoscaler_prefill_desired_replicas",
            "Disaggregated: prefill replicas the last decision asked for.",
            labels,
            registry=self.registry,
        )
        self.prefill_prompt_tokens = Gauge(
            "servefleet_autoscaler_prefill_prompt_tokens",
            "Disaggregated: prompt tokens queued for and running on the prefill pool, as last "
            "read (not updated while unknown).",
            labels,
            registry=self.registry,
        )
        self.errors = Counter(
            "servefleet_autoscaler_errors",
            "Ticks that failed to observe or actuate.",
            [*labels, "stage"],
            registry=self.registry,
        )

    def record(self, deployment: str, decision: Decision) -> None:
        self.desired.labels(deployment).set(decision.desired)
        self.current.labels(deployment).set(decision.current)
        self.demand.labels(deployment).set(decision.demand)
        self.cold_start.labels(deployment).set(decision.cold_start_s)
        for reason in Reason:
            self.reason.labels(deployment, reason.value).set(
                1.0 if reason is decision.reason else 0.0
            )
        self.decisions.labels(deployment, decision.reason.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
