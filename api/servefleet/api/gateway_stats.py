"""What a gateway reports about each deployment: `GET /internal/deployments`.

The gateway's pools build these models and the autoscaler parses the same ones, so the two
sides cannot drift. Unknown fields are ignored and most fields have defaults, so a gateway
one version ahead of the autoscaler (a rolling upgrade) is still read.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from servefleet.api.batch_demand import BatchDue


class ReplicaHealth(enum.StrEnum):
    """Whether the gateway sends new requests to a replica (not the pod's lifecycle)."""

    STARTING = "starting"  # not ready yet: no traffic
    READY = "ready"
    DRAINING = "draining"  # answered 503 on /ready: finishes what it has, takes nothing new
    EJECTED = "ejected"  # failed: out until its back-off ends, then one trial request


class _StatsModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class GatewayReplicaStats(_StatsModel):
    endpoint: str
    state: ReplicaHealth = ReplicaHealth.READY
    outstanding: int = Field(default=0, ge=0, description="requests in flight on it")
    cap: int = Field(default=0, ge=0, description="its concurrency cap")
    served: int = Field(default=0, ge=0, description="requests completed since start")
    adapters: list[str] = Field(
        default_factory=list, description="LoRA adapters it holds, as the gateway last saw"
    )


class DeploymentStats(_StatsModel):
    """One deployment as one gateway replica sees it."""

    name: str
    model: str = ""
    queue_depth: int = Field(default=0, ge=0)
    queue_depth_interactive: int = Field(default=0, ge=0)
    queue_depth_batch: int = Field(default=0, ge=0)
    in_flight: int = Field(default=0, ge=0)
    in_flight_batch: int = Field(
        default=0, ge=0, description="of in_flight, batch requests: load that buys no replicas"
    )
    service_rate: float = Field(default=0.0, ge=0, description="req/s the ready replicas complete")
    completions_per_second: float = Field(default=0.0, ge=0, description="last minute")
    spilled_per_second: float = Field(
        default=0.0, ge=0, description="requests sent to the hosted API instead, last minute"
    )
    spilled_tokens_per_second: float = Field(
        default=0.0,
        ge=0,
        description="their tokens (prompt + completion budget, an upper bound), last minute",
    )
    batch_lines_left: int = Field(
        default=0, ge=0, description="lines of open batches (Batch API) for it, not answered yet"
    )
    batch_lines_per_second_needed: float = Field(
        default=0.0,
        ge=0,
        description="the line rate that answers every open batch by its deadline, earliest "
        "deadline first (the autoscaler buys replicas for it)",
    )
    batch_due: list[BatchDue] = Field(
        default_factory=list,
        description="each open batch's lines for it and deadline: the autoscaler merges "
        "gateway replicas' reports by batch (replicas over one store all see every batch)",
    )
    mean_service_seconds: float | None = None
    cold_start_seconds: float | None = Field(default=None, description="measured, else the prior")
    queue_wait_p90_seconds: float | None = Field(
        default=None, description="interactive requests, last minute"
    )
    ttft_p90_seconds: float | None = Field(default=None, description="last minute")
    prompt_token_count: Literal["estimate", "tokenizer"] = "estimate"
    ready_replicas: int = Field(default=0, ge=0)
    adapter_load_errors: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters whose last load was refused, and the engine's reason",
    )
    replicas: list[GatewayReplicaStats] = Field(default_factory=list)
    prefill_prompt_tokens_queued: int | None = Field(
        default=None,
        ge=0,
        description="Disaggregated: uncached prompt tokens waiting for a prefill replica; "
        "None: colocated, or a gateway that does not report it (unknown, never zero)",
    )
    prefill_prompt_tokens_running: int | None = Field(
        default=None, ge=0, description="Disaggregated: prompt tokens being prefilled now"
    )
    prefill: list[GatewayReplicaStats] = Field(
        default_factory=list, description="Disaggregated: the prefill pool's replicas"
    )

    @property
    def prefill_prompt_tokens(self) -> int | None:
        """Queued plus running prompt tokens of the prefill pool: its autoscaling signal."""
        queued, running = self.prefill_prompt_tokens_queued, self.prefill_prompt_tokens_running
        if queued is None and running is None:
            return None
        return (queued or 0) + (running or 0)


_DEPLOYMENT_LIST = TypeAdapter(list[DeploymentStats])


def dump_deployment_stats(stats: list[DeploymentStats]) -> bytes:
    """The body of `GET /internal/deployments`: a JSON list."""
    return _DEPLOYMENT_LIST.dump_json(stats)


def parse_deployment_stats(body: Any) -> dict[str, DeploymentStats]:
    """By deployment name; accepts the list or `{"deployments": [...]}`."""
    items = body.get("deployments", []) if isinstance(body, Mapping) else body
    if not isinstance(items, list):
        raise ValueError("gateway stats: expected a list of deployments")
    return {d.name: d for d in _DEPLOYMENT_LIST.validate_python(items)}
