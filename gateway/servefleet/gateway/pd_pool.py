"""The prefill pool of a disaggregated deployment as a deployment of its own (`pd`).

Kept apart from `pd` so the pool module can build it without importing what imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

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
