"""Scrape a deployment's demand: the gateway's queue plus every replica's engine metrics.

The gateway is read through `GatewaySource` (HTTP `GET /internal/deployments`, or the
in-process pool objects in local mode); replicas are scraped over HTTP concurrently. A
replica whose scrape fails still counts, with the load the gateway says it carries, so one
slow `/metrics` cannot make the pool look idle and trigger a scale-down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import httpx
from pydantic import BaseModel, ConfigDict

from servefleet.api.engines import engine_adapter
from servefleet.api.gateway_stats import DeploymentStats, parse_deployment_stats

from .engine_metrics import EngineLoad, MetricsFormatError, parse_engine_load
from .signals import Observation, ReplicaLoad, ReplicaState

log = logging.getLogger(__name__)


class GatewaySource(Protocol):
    async def deployments(self) -> dict[str, DeploymentStats]: ...


class HttpGatewaySource:
    """The gateway's internal stats endpoint (Kubernetes: the gateway Service)."""

    def __init__(self, base_url: str, client: httpx.AsyncClient, api_key: str | None = None):
        self._url = base_url.rstrip("/") + "/internal/deployments"
        self._client = client
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def deployments(self) -> dict[str, DeploymentStats]:
        response = await self._client.get(self._url, headers=self._headers)
        response.raise_for_status()
        return parse_deployment_stats(response.json())


class InProcessGatewaySource:
    """Local mode: the in-process gateway's stats, no HTTP in between."""

    def __init__(self, stats: Callable[[], Iterable[DeploymentStats]]) -> None:
        self._stats = stats

    async def deployments(self) -> dict[str, DeploymentStats]:
        return {s.name: s for s in self._stats()}


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
        metrics_path = engine_adapter(engine_kind).metrics_path
        response = await client.get(base_url.rstrip("/") + metrics_path)
        response.raise_for_status()
        return parse_engine_load(response.text, engine_kind, model_name)
    except (httpx.HTTPError, MetricsFormatError) as exc:
        log.debug("scrape of %s failed: %s", base_url, exc)
        return None


async def observe_deployment(
    *,
    client: httpx.AsyncClient,
    gateway: DeploymentStats | None,
    replicas: Sequence[ReplicaTarget],
    engine_kind: str = "servefleet",
    model_name: str | None = None,
    gateway_known: bool = True,
) -> Observation:
    """One `Observation`: gateway queue + per-replica engine load + measured latencies.

    `gateway_known=False` (the gateways could not be read) marks the queue unknown, so the
    policy holds instead of reading an empty queue as zero demand.
    """
    outstanding = {
        r.endpoint.rstrip("/"): r.outstanding for r in (gateway.replicas if gateway else [])
    }
    scrape = [
        scrape_engine(client, r.base_url, engine_kind, model_name)
        if r.state not in (ReplicaState.STARTING, ReplicaState.PENDING)
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
        gateway_queued_batch=gateway.queue_depth_batch if gateway else 0,
        in_flight_batch=gateway.in_flight_batch if gateway else 0,
        mean_service_s=(gateway.mean_service_seconds or None) if gateway else None,
        spilled_per_s=gateway.spilled_per_second if gateway else 0.0,
        spilled_tokens_per_s=gateway.spilled_tokens_per_second if gateway else 0.0,
        batch_lines_per_s_needed=gateway.batch_lines_per_second_needed if gateway else 0.0,
        unknown=() if gateway_known else ("gateway",),
    )


async def _none() -> None:
    return None
