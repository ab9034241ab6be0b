"""The prefill pool of a disaggregated deployment as a deployment of its own (`pd`).

Kept apart from `pd` so the pool module can build it without importing what imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servefleet.api.disaggregation import PREFILL_SUFFIX
from servefleet.api.gateway_config import GatewayDeployment
from servefleet.gateway.routing import Replica, ReplicaSet


def prefill_deployment(config: GatewayDeployment) -> GatewayDeployment | None:
    """The prefill pool as a deployment of its own (replicas, probes, discovery); None when
    the deployment is colocated. It serves no tenant and pulls nothing."""
    prefill = config.prefill
    if prefill is None:
        return None
    return config.model_copy(
        update={
            "name": config.name + PREFILL_SUFFIX,
            "endpoints": list(prefill.endpoints),
            "service": prefill.service,
            "pool": prefill.pool,
            "prefill": None,
            "tenants": [],
            "kv_pull_min_tokens": None,
        }
    )


@dataclass(slots=True)
class PrefillLease:
    """A prefill replica's share of one request: its prompt tokens count as its load."""

    replicas: ReplicaSet
    replica: Replica
    tokens: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.replicas.release(self.replica, self.tokens)


@dataclass(slots=True)
class PromptTokenGauge:
    """Prompt tokens that reached the threshold but found no prefill replica with room: the
    decode replicas prefill them, and the prefill pool's autoscaler reads them as its queued
    demand (`DeploymentStats.prefill_prompt_tokens_queued`)."""

    value: int = 0


@dataclass(slots=True)
class PrefillOverflow:
    """One request's share of `PromptTokenGauge`, returned when its decode replica answers."""

    gauge: PromptTokenGauge
    tokens: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gauge.value -= self.tokens


def prefill_stats(replicas: ReplicaSet | None, overflow: PromptTokenGauge) -> dict[str, Any]:
    """The prefill pool's autoscaling signal (disaggregated only): prompt tokens on its
    replicas now, and those that found none with room and went to a decode replica."""
    if replicas is None:
        return {}
    return {
        "prefill_prompt_tokens_running": sum(
            r.outstanding_tokens for r in replicas.replicas.values()
        ),
        "prefill_prompt_tokens_queued": overflow.value,
        "prefill": replicas.stats(),
    }
