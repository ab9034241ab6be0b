"""Every gateway replica's view of the queue, summed: the chart runs several gateways.

Each gateway queues and forwards its own share of the requests, so one replica's stats are a
fraction of the demand. The replicas are found like the gateway finds engines, through the
EndpointSlices of their Service, read concurrently, and summed per deployment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import httpx

from servefleet.api.batch_demand import lines_per_second_needed, merge_batch_due
from servefleet.api.conventions import GATEWAY_INTERNAL_PORT_NAME
from servefleet.api.gateway_stats import DeploymentStats, GatewayReplicaStats
from servefleet.kube import KubeClient, KubeError
from servefleet.kube.endpoints import service_selector, slice_endpoints
from servefleet.kube.resources import ENDPOINT_SLICES

from .observe import HttpGatewaySource

log = logging.getLogger(__name__)


def _max(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _sum_replicas(views: list[DeploymentStats]) -> list[GatewayReplicaStats]:
    """One entry per engine replica: requests every gateway has on it, added up."""
    merged: dict[str, GatewayReplicaStats] = {}
    for view in views:
        for replica in view.replicas:
            seen = merged.get(replica.endpoint)
            if seen is None:
                merged[replica.endpoint] = replica.model_copy()
                continue
            merged[replica.endpoint] = seen.model_copy(
                update={
                    "outstanding": seen.outstanding + replica.outstanding,
                    "served": seen.served + replica.served,
                    "cap": max(seen.cap, replica.cap),
                    "adapters": sorted(set(seen.adapters) | set(replica.adapters)),
                }
            )
    return list(merged.values())


def _sum_known(values: Iterable[int | None]) -> int | None:
    """A sum only when every gateway reported it: a partial sum would read as less demand."""
    known = list(values)
    return None if any(v is None for v in known) else sum(v or 0 for v in known)


def _merged_batches(views: list[DeploymentStats], now: float | None = None) -> dict[str, Any]:
    """Open batches' lines and the line rate their deadlines need, one figure per batch:
    replicas over one store all report every batch (`servefleet.api.batch_demand`). A
    gateway that reports lines but no batches (an older one) is added as it is."""
    merged = merge_batch_due(v.batch_due for v in views)
    unlisted = [v for v in views if not v.batch_due]
    rate = lines_per_second_needed(
        ((d.lines, d.expires_at) for d in merged), time.time() if now is None else now
    )
    return {
        "batch_due": merged,
        "batch_lines_left": sum(d.lines for d in merged)
        + sum(v.batch_lines_left for v in unlisted),
        "batch_lines_per_second_needed": rate
        + sum(v.batch_lines_per_second_needed for v in unlisted),
    }


def _sum_deployment(views: list[DeploymentStats]) -> DeploymentStats:
    """Counts add up. Latencies are p90s, which do not add: the largest is kept, an upper
    bound of the p90 over all gateways' requests together (what a scaler should act on)."""
    first = views[0]
    return first.model_copy(
        update={
            "model": next((v.model for v in views if v.model), ""),
            "queue_depth": sum(v.queue_depth for v in views),
            "queue_depth_interactive": sum(v.queue_depth_interactive for v in views),
            "queue_depth_batch": sum(v.queue_depth_batch for v in views),
            "in_flight": sum(v.in_flight for v in views),
            "in_flight_batch": sum(v.in_flight_batch for v in views),
            "completions_per_second": sum(v.completions_per_second for v in views),
            "spilled_per_second": sum(v.spilled_per_second for v in views),
            "spilled_tokens_per_second": sum(v.spilled_tokens_per_second for v in views),
            **_merged_batches(views),
            "service_rate": max(v.service_rate for v in views),
            "mean_service_seconds": _max(v.mean_service_seconds for v in views),
            "cold_start_seconds": _max(v.cold_start_seconds for v in views),
            "queue_wait_p90_seconds": _max(v.queue_wait_p90_seconds for v in views),
            "ttft_p90_seconds": _max(v.ttft_p90_seconds for v in views),
            "ready_replicas": max(v.ready_replicas for v in views),
            "replicas": _sum_replicas(views),
            "prefill_prompt_tokens_queued": _sum_known(
                v.prefill_prompt_tokens_queued for v in views
            ),
            "prefill_prompt_tokens_running": _sum_known(
                v.prefill_prompt_tokens_running for v in views
            ),
            "adapter_load_errors": {
                name: why for v in views for name, why in v.adapter_load_errors.items()
            },
        }
    )


def sum_deployment_stats(
    per_gateway: Iterable[dict[str, DeploymentStats]],
) -> dict[str, DeploymentStats]:
    """Per deployment, the sum over gateway replicas (each a `{name: stats}` answer)."""
    views: dict[str, list[DeploymentStats]] = {}
    for answer in per_gateway:
        for name, stats in answer.items():
            views.setdefault(name, []).append(stats)
    return {name: _sum_deployment(found) for name, found in views.items()}


class GatewayFleetSource:
    """Every ready replica of the gateway Service, read and summed each time it is asked."""

    def __init__(
        self,
        kube: KubeClient,
        namespace: str,
        service: str,
        client: httpx.AsyncClient,
        *,
        port_name: str = GATEWAY_INTERNAL_PORT_NAME,
        api_key: str | None = None,
    ) -> None:
        self._kube = kube
        self._namespace = namespace
        self._service = service
        self._client = client
        self._port_name = port_name
        self._api_key = api_key

    async def endpoints(self) -> list[str]:
        """Base URLs of the ready gateway replicas."""
        slices = await self._kube.list(
            ENDPOINT_SLICES, self._namespace, service_selector(self._service)
        )
        ready = {url for s in slices.items for url in slice_endpoints(s, self._port_name)[1]}
        return sorted(ready)

    async def deployments(self) -> dict[str, DeploymentStats]:
        urls = await self.endpoints()
        if not urls:
            raise KubeError(0, f"gateway Service {self._namespace}/{self._service}: no ready pods")
        sources = [HttpGatewaySource(url, self._client, self._api_key) for url in urls]
        answers = await asyncio.gather(*(s.deployments() for s in sources), return_exceptions=True)
        read = [a for a in answers if not isinstance(a, BaseException)]
        for url, answer in zip(urls, answers, strict=True):
            if isinstance(answer, BaseException):
                log.warning(
                    "gateway %s: stats unavailable (%s); its queue is not counted", url, answer
                )
        if not read:
            failure = answers[0]
            assert isinstance(failure, BaseException)
            raise failure
        return sum_deployment_stats(read)
