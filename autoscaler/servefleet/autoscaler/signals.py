"""What the autoscaler observes: one snapshot of a deployment's demand and replicas.

Kept free of any scraping or Kubernetes detail so the policy and the simulator share it.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class ReplicaState(StrEnum):
    """Lifecycle of one engine replica as the autoscaler sees it."""

    PENDING = "pending"
    """Asked for but not placed yet (no free GPU or core): it may never come."""
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"


class ReplicaLoad(BaseModel):
    """Load of one replica, read from its `/metrics` (or the simulator)."""

    model_config = ConfigDict(frozen=True)

    name: str
    state: ReplicaState
    waiting: int = Field(default=0, ge=0, description="requests queued inside the engine")
    running: int = Field(default=0, ge=0, description="requests being decoded")
    kv_cache_usage: float = Field(
        default=0.0, ge=0.0, le=1.0, description="share of KV blocks in use"
    )

    @property
    def in_flight(self) -> int:
        return self.waiting + self.running


class Observation(BaseModel):
    """One scrape of a deployment: gateway queue, per-replica load, measured latency."""

    model_config = ConfigDict(frozen=True)

    gateway_queued: int = Field(default=0, ge=0, description="requests queued in the gateway")
    replicas: tuple[ReplicaLoad, ...] = ()
    queue_wait_s: float | None = Field(
        default=None, ge=0.0, description="recent queue wait users saw (e.g. p90), if measured"
    )
    ttft_s: float | None = Field(
        default=None, ge=0.0, description="recent time to first token (e.g. p90), if measured"
    )
    gateway_queued_batch: int = Field(
        default=0,
        ge=0,
        description="of gateway_queued, batch-class requests: they may wait or spill, and buy "
        "no replicas by themselves",
    )
    in_flight_batch: int = Field(
        default=0,
        ge=0,
        description="of the requests in flight on replicas, batch ones (the gateway knows the "
        "class, engines do not): load, but no demand that buys replicas",
    )
    gateways: int = Field(
        default=1, ge=0, description="gateway replicas whose counts were summed into this one"
    )
    unknown: tuple[str, ...] = Field(
        default=(),
        description="signals that could not be read this time (a gateway, a replica's "
        "/metrics): their counts are not zeros, so the policy holds instead of shrinking",
    )
    observed_at: float | None = Field(
        default=None, description="when these numbers were measured, on the policy's clock"
    )
    free_capacity: int | None = Field(
        default=None,
        ge=0,
        description="replicas more the machine or cluster can place now (local mode: free "
        "cores); None = no known limit",
    )
    spilled_per_s: float = Field(
        default=0.0, ge=0.0, description="requests/s recently sent to the hosted API instead"
    )
    spilled_tokens_per_s: float = Field(
        default=0.0, ge=0.0, description="prompt + completion tokens/s of those requests"
    )
    mean_service_s: float | None = Field(
        default=None, gt=0.0, description="seconds a request holds a replica slot, if measured"
    )
    batch_lines_per_s_needed: float = Field(
        default=0.0,
        ge=0.0,
        description="the line rate that answers every open batch by its deadline (Batch API)",
    )

    def count(self, state: ReplicaState) -> int:
        return sum(1 for r in self.replicas if r.state is state)

    @property
    def demand(self) -> int:
        """Requests that need a slot: queued in the gateway plus in flight on live replicas.

        Draining replicas are left out: their work is finishing and needs no new capacity.
        """
        live = sum(r.in_flight for r in self.replicas if r.state is not ReplicaState.DRAINING)
        return self.gateway_queued + live
