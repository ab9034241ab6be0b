"""Scrape a deployment's demand: the gateway's queue plus every replica's engine metrics.

The gateway is read through `GatewaySource` (HTTP `GET /internal/deployments`, or the
in-process pool objects in local mode); replicas are scraped over HTTP concurrently. A
replica whose scrape fails still counts, with the load the gateway says it carries, so one
slow `/metrics` cannot make the pool look idle and trigger a scale-down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field

from .engine_metrics import EngineLoad, MetricsFormatError, parse_engine_load
from .signals import Observation, ReplicaLoad, ReplicaState

log = logging.getLogger(__name__)


class GatewayReplicaStats(BaseModel):
    model_config = ConfigDict(extra="ignore")

    endpoint: str
    state: str = ""
    outstanding: int = 0


class GatewayDeploymentStats(BaseModel):
    """One entry of the gateway's `GET /internal/deployments` (unknown fields ignored)."""

    model_config = ConfigDict(extra="ignore")

    name: str
    model: str = ""
    queue_depth: int = Field(default=0, ge=0)
    in_flight: int = Field(default=0, ge=0)
    cold_start_seconds: float | None = None
    queue_wait_p90_seconds: float | None = None
    ttft_p90_seconds: float | None = None
    replicas: list[GatewayReplicaStats] = Field(default_factory=list)


def parse_gateway_stats(body: Any) -> dict[str, GatewayDeploymentStats]:
    """Accepts a list of deployments or `{"deployments": [...]}`."""
    items = body.get("deployments", []) if isinstance(body, Mapping) else body
    if not isinstance(items, list):
        raise ValueError("gateway stats: expected a list of deployments")
    parsed = [GatewayDeploymentStats.model_validate(item) for item in items]
    return {d.name: d for d in parsed}


class GatewaySource(Protocol):
    async def deployments(self) -> dict[str, GatewayDeploymentStats]: ...


class HttpGatewaySource:
    """The gateway's internal stats endpoint (Kubernetes: the gateway Service)."""

    def __init__(self, base_url: str, client: httpx.AsyncClient, api_key: str | None = None):
        self._url = base_url.rstrip("/") + "/internal/deployments"
        self._client = client
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def deployments(self) -> dict[str, GatewayDeploymentStats]:
        response = await self._client.get(self._url, headers=self._headers)
        response.raise_for_status()
        return parse_gateway_stats(response.json())


class InProcessGatewaySource:
    """Local mode: read the gateway's pool objects directly (anything with `.stats()`)."""

    def __init__(self, stats: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        self._stats = stats

    async def deployments(self) -> dict[str, GatewayDeploymentStats]:
        return parse_gateway_stats([dict(s) for s in self._stats()])


class ReplicaTarget(BaseModel):
    """A replica to scrape, with the lifecycle state its owner (supervisor, pods) knows."""

    model_config = ConfigDict(frozen=True)

    name: str
    base_url: str
    state: ReplicaState


async def scrape_engine(
    client: httpx.AsyncClient, base_url: str, engine_kind: str, model_name: str | None
) -> EngineLoad | None:
    try:
        response = await client.get(base_url.rstrip("/") + "/metrics")
        response.raise_for_status()
        return parse_engine_load(response.text, engine_kind, model_name)
    except (httpx.HTTPError, MetricsFormatError) as exc:
        log.debug("scrape of %s failed: %s", base_url, exc)
        return None


async def observe_deployment(
    *,
    client: httpx.AsyncClient,
    gateway: GatewayDeploymentStats | None,
    replicas: Sequence[ReplicaTarget],
    engine_kind: str = "servefleet",
    model_name: str | None = None,
) -> Observation:
    """One `Observation`: gateway queue + per-replica engine load + measured latencies."""
    outstanding = {
        r.endpoint.rstrip("/"): r.outstanding for r in (gateway.replicas if gateway else [])
    }
    scrape = [
        scrape_engine(client, r.base_url, engine_kind, model_name)
        if r.state is not ReplicaState.STARTING
        else _none()
        for r in replicas
    ]
    loads = await asyncio.gather(*scrape)
    observed = []
    for replica, load in zip(replicas, loads, strict=True):
        if load is None:
            running = outstanding.get(replica.base_url.rstrip("/"), 0)
            observed.append(ReplicaLoad(name=replica.name, state=replica.state, running=running))
        else:
            observed.append(
                ReplicaLoad(
                    name=replica.name,
                    state=replica.state,
                    waiting=load.waiting,
                    running=load.running,
                    kv_cache_usage=load.kv_cache_usage,
                )
            )
    return Observation(
        gateway_queued=gateway.queue_depth if gateway else 0,
        replicas=tuple(observed),
        queue_wait_s=gateway.queue_wait_p90_seconds if gateway else None,
        ttft_s=gateway.ttft_p90_seconds if gateway else None,
    )


async def _none() -> None:
    return None
