"""The autoscaler on Kubernetes: every LLMDeployment in a namespace, every `interval`.

Replica states come from the engine pods (deleting → draining, Ready → ready, else starting);
demand from the gateway's `GET /internal/deployments` and each pod's `/metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
from pydantic import ValidationError

from servefleet.api.llmdeployment import LLMDeployment

from .actuate import KubernetesActuator
from .controller import DeploymentAutoscaler
from .kube import KubeClient
from .observe import GatewaySource, ReplicaTarget, observe_deployment
from .signals import Observation, ReplicaState
from .spec import targets_from_spec
from .telemetry import AutoscalerMetrics

log = logging.getLogger(__name__)

DEFAULT_ENGINE_PORT = 8000


def replica_from_pod(pod: dict[str, Any]) -> ReplicaTarget | None:
    meta, status = pod.get("metadata", {}), pod.get("status", {})
    ip = status.get("podIP")
    if not ip:
        return None
    if meta.get("deletionTimestamp"):
        state = ReplicaState.DRAINING
    elif any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", [])
    ):
        state = ReplicaState.READY
    else:
        state = ReplicaState.STARTING
    port = DEFAULT_ENGINE_PORT
    for container in pod.get("spec", {}).get("containers", []):
        for declared in container.get("ports", []):
            if declared.get("name") == "http":
                port = int(declared["containerPort"])
    return ReplicaTarget(name=meta["name"], base_url=f"http://{ip}:{port}", state=state)


class ClusterAutoscaler:
    def __init__(
        self,
        kube: KubeClient,
        namespace: str,
        gateway: GatewaySource,
        metrics: AutoscalerMetrics,
        http: httpx.AsyncClient,
    ) -> None:
        self._kube = kube
        self._namespace = namespace
        self._gateway = gateway
        self._metrics = metrics
        self._http = http
        self._actuator = KubernetesActuator(kube, namespace)
        self._scalers: dict[str, DeploymentAutoscaler] = {}

    async def tick(self) -> None:
        items = await self._kube.list_llmdeployments(self._namespace)
        try:
            stats = await self._gateway.deployments()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("gateway stats unavailable (%s); engine metrics only", exc)
            stats = {}
        seen = set()
        for item in items:
            try:
                dep = LLMDeployment.model_validate(item)
            except ValidationError as exc:
                log.warning("skipping invalid LLMDeployment: %s", exc)
                continue
            if not dep.spec.autoscaling.enabled or not dep.status.selector:
                continue
            seen.add(dep.name)
            scaler = self._scaler(dep, stats)
            scaler.targets = targets_from_spec(dep.spec)
            await scaler.tick(time.monotonic())
        for gone in set(self._scalers) - seen:
            del self._scalers[gone]

    def _scaler(self, dep: LLMDeployment, stats: dict[str, Any]) -> DeploymentAutoscaler:
        scaler = self._scalers.get(dep.name)
        selector, spec, name = dep.status.selector, dep.spec, dep.name

        async def observe() -> Observation:
            pods = await self._kube.list_pods(self._namespace, selector)
            replicas = [r for r in map(replica_from_pod, pods) if r is not None]
            return await observe_deployment(
                client=self._http,
                gateway=stats.get(name),
                replicas=replicas,
                engine_kind=spec.engine.kind,
                model_name=spec.model.name,
            )

        if scaler is None:
            scaler = DeploymentAutoscaler(
                name, targets_from_spec(spec), observe, self._actuator, self._metrics
            )
            self._scalers[name] = scaler
        else:
            scaler.set_observe(observe)
        return scaler

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("autoscaler tick failed")
            await asyncio.sleep(interval_s)
