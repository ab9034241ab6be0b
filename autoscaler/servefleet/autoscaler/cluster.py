"""The autoscaler on Kubernetes: every LLMDeployment it watches, every `interval`.

It watches the namespaces the operator watches (none named: every namespace), so whatever
the operator reconciles is also autoscaled.

Replica states come from the engine pods (deleting → draining, Ready → ready, else starting);
demand from every gateway replica's `GET /internal/deployments` (summed) and each pod's
`/metrics`. The gateway queue it acts on is also written to `status.queueDepth`, so
`kubectl get llmd` shows the number the autoscaler scaled by.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
from pydantic import ValidationError

from servefleet.api.conventions import ENGINE_PORT_NAME, FIELD_MANAGER_AUTOSCALER, route_scoped
from servefleet.api.engines import ENGINE_ADAPTERS
from servefleet.api.gateway_stats import DeploymentStats
from servefleet.api.llmadapter import LLMAdapter
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.kube import KubeClient, KubeError
from servefleet.kube.endpoints import address_url
from servefleet.kube.resources import LLM_ADAPTERS, LLM_DEPLOYMENTS, PODS

from .actuate import KubernetesActuator
from .adapter_status import adapter_status_patch, forget_loaded_patch, is_accepted, now_rfc3339
from .controller import DeploymentAutoscaler
from .observe import GatewaySource, ReplicaTarget, observe_deployment
from .prefill import PrefillScaler
from .signals import Observation, ReplicaState
from .spec import targets_from_spec
from .telemetry import AutoscalerMetrics

log = logging.getLogger(__name__)

DEFAULT_ENGINE_PORT = ENGINE_ADAPTERS["servefleet"].port


def _condition(status: dict[str, Any], type_: str) -> str | None:
    for condition in status.get("conditions", []):
        if condition.get("type") == type_:
            return str(condition.get("status"))
    return None


def replica_from_pod(pod: dict[str, Any]) -> ReplicaTarget | None:
    """A pod as the policy sees it; an unschedulable one is PENDING (coming, with patience)."""
    meta, status = pod.get("metadata", {}), pod.get("status", {})
    ip = status.get("podIP")
    if not ip:
        if meta.get("deletionTimestamp"):
            return None
        # No node fits (e.g. no free GPU): counts as coming only for a bounded patience.
        unschedulable = _condition(status, "PodScheduled") == "False"
        state = ReplicaState.PENDING if unschedulable else ReplicaState.STARTING
        return ReplicaTarget(name=meta["name"], base_url="", state=state)
    if meta.get("deletionTimestamp"):
        state = ReplicaState.DRAINING
    elif _condition(status, "Ready") == "True":
        state = ReplicaState.READY
    else:
        state = ReplicaState.STARTING
    port = DEFAULT_ENGINE_PORT
    for container in pod.get("spec", {}).get("containers", []):
        for declared in container.get("ports", []):
            if declared.get("name") == ENGINE_PORT_NAME:
                port = int(declared["containerPort"])
    # Written as the gateways write the replica (EndpointSlices): the adapter report maps
    # their endpoints back to pod names, and an IPv6 address needs its brackets in a URL.
    return ReplicaTarget(name=meta["name"], base_url=address_url(ip, port), state=state)


def _adapter(item: dict[str, Any]) -> LLMAdapter | None:
    try:
        return LLMAdapter.model_validate(item)
    except ValidationError:
        return None  # the operator says why in its status


def gateway_name(dep: LLMDeployment) -> str:
    """The deployment's name in the gateway's stats and metrics (`<namespace>/<name>`: routes
    are scoped to their namespace); the autoscaler's own series use it too, so alerts join."""
    return route_scoped(dep.namespace, dep.name)


class ClusterAutoscaler:
    def __init__(
        self,
        kube: KubeClient,
        namespaces: list[str],
        gateway: GatewaySource,
        metrics: AutoscalerMetrics,
        http: httpx.AsyncClient,
    ) -> None:
        self._kube = kube
        self._namespaces = namespaces  # empty: every namespace
        self._gateway = gateway
        self._metrics = metrics
        self._http = http
        self._actuators: dict[str, KubernetesActuator] = {}
        self._scalers: dict[tuple[str, str], DeploymentAutoscaler] = {}
        self._prefill: dict[tuple[str, str], PrefillScaler] = {}

    async def _list_deployments(self) -> list[dict[str, Any]]:
        if not self._namespaces:
            return (await self._kube.list(LLM_DEPLOYMENTS, None)).items
        items: list[dict[str, Any]] = []
        for namespace in self._namespaces:
            items += (await self._kube.list(LLM_DEPLOYMENTS, namespace)).items
        return items

    def _actuator(self, namespace: str) -> KubernetesActuator:
        if namespace not in self._actuators:
            self._actuators[namespace] = KubernetesActuator(self._kube, namespace)
        return self._actuators[namespace]

    async def tick(self) -> None:
        items = await self._list_deployments()
        stats: dict[str, DeploymentStats] | None
        try:
            stats = await self._gateway.deployments()
        except (httpx.HTTPError, KubeError, ValueError) as exc:
            log.warning("gateway stats unavailable (%s); engine metrics only", exc)
            stats = None
        seen = set()
        deployments: list[LLMDeployment] = []
        for item in items:
            try:
                dep = LLMDeployment.model_validate(item)
            except ValidationError as exc:
                log.warning("skipping invalid LLMDeployment: %s", exc)
                continue
            deployments.append(dep)
            if not dep.spec.autoscaling.enabled or not dep.status.selector:
                continue
            seen.add((dep.namespace, dep.name))
            scaler = self._scaler(dep, stats)
            await scaler.tick(time.monotonic())
            await self._scale_prefill(dep, stats)
            if stats is not None:
                await self._report_queue_depth(dep, stats.get(gateway_name(dep)))
        for gone in set(self._scalers) - seen:
            del self._scalers[gone]
        for gone in set(self._prefill) - seen:
            del self._prefill[gone]
        if stats is not None:  # unknown without the gateways: nothing is written
            await self._report_adapters(deployments, stats)

    async def _scale_prefill(
        self, dep: LLMDeployment, stats: dict[str, DeploymentStats] | None
    ) -> None:
        """A disaggregated deployment's prefill pool, from its prompt-token signal (`prefill`)."""
        key = (dep.namespace, dep.name)
        if dep.spec.disaggregation is None:
            self._prefill.pop(key, None)
            return
        dep_stats = stats.get(gateway_name(dep)) if stats is not None else None
        tokens = dep_stats.prefill_prompt_tokens if dep_stats is not None else None
        scaler = self._prefill.setdefault(key, PrefillScaler(self._kube))
        name = gateway_name(dep)
        if tokens is not None:
            self._metrics.prefill_prompt_tokens.labels(name).set(tokens)
        try:
            decision = await scaler.tick(dep, tokens, time.monotonic())
        except KubeError as exc:
            log.warning("%s: cannot scale the prefill pool: %s", dep.name, exc)
            self._metrics.errors.labels(name, "actuate").inc()
            return
        if decision is not None:
            self._metrics.prefill_desired.labels(name).set(decision.desired)
            if decision.desired != decision.current:
                log.info("autoscaler %s: prefill replicas %d -> %d (%s)",
                         name, decision.current, decision.desired, decision.reason)  # fmt: skip

    async def _report_adapters(
        self, deployments: list[LLMDeployment], stats: dict[str, DeploymentStats]
    ) -> None:
        """Each LLMAdapter of the watched namespaces: where it is loaded (`adapter_status`);
        one no route serves (refused, its deployment gone) loaded nowhere."""
        served = {(d.namespace, d.name): d for d in deployments if d.spec.engine.lora is not None}
        pod_names: dict[tuple[str, str], dict[str, str]] = {}
        now = now_rfc3339()
        for item in await self._list_adapters():
            adapter = _adapter(item)
            if adapter is None:
                continue
            dep = served.get((adapter.namespace, adapter.spec.deployment))
            dep_stats = stats.get(gateway_name(dep)) if dep is not None else None
            try:
                if not is_accepted(adapter):
                    patch = forget_loaded_patch(adapter)
                elif dep is not None and dep_stats is not None:
                    names = await self._pod_names(dep, pod_names)
                    patch = adapter_status_patch(adapter, dep_stats, names, now)
                else:
                    continue  # the gateways do not show its deployment (yet): unknown
                if patch is not None:
                    await self._write_adapter_status(item, patch)
            except KubeError as exc:
                log.warning("LLMAdapter %s/%s: cannot write its status: %s",
                            adapter.namespace, adapter.name, exc)  # fmt: skip

    async def _list_adapters(self) -> list[dict[str, Any]]:
        """The LLMAdapters of the watched namespaces; none where the CRD is not installed."""
        items: list[dict[str, Any]] = []
        namespaces: list[str | None] = [*self._namespaces] or [None]
        for namespace in namespaces:
            try:
                items += (await self._kube.list(LLM_ADAPTERS, namespace)).items
            except KubeError as exc:
                if exc.status != 404:
                    log.warning("cannot list LLMAdapters (%s): %s", namespace or "all", exc)
        return items

    async def _pod_names(
        self, dep: LLMDeployment, cache: dict[tuple[str, str], dict[str, str]]
    ) -> dict[str, str]:
        """Engine pod names by their replica URL (as the gateways name replicas)."""
        key = (dep.namespace, dep.name)
        if key not in cache:
            pods = (await self._kube.list(PODS, dep.namespace, dep.status.selector)).items
            replicas = (r for r in map(replica_from_pod, pods) if r is not None)
            cache[key] = {r.base_url: r.name for r in replicas if r.base_url}
        return cache[key]

    async def _write_adapter_status(self, item: dict[str, Any], patch: dict[str, Any]) -> None:
        """The patch, on the condition that the adapter is still the one it was computed from
        (`conditions` is written whole): a 409 leaves it to the next tick."""
        meta = item["metadata"]
        precondition = {"metadata": {"resourceVersion": meta["resourceVersion"]}}
        try:
            await self._kube.patch_status(
                LLM_ADAPTERS, meta["namespace"], meta["name"], precondition | patch,
                FIELD_MANAGER_AUTOSCALER,
            )  # fmt: skip
        except KubeError as exc:
            if exc.status != 409:
                raise
            log.info("LLMAdapter %s/%s changed meanwhile; its status is written next tick",
                     meta["namespace"], meta["name"])  # fmt: skip

    async def _report_queue_depth(self, dep: LLMDeployment, stats: DeploymentStats | None) -> None:
        """`status.queueDepth`: requests waiting in the gateways, written only on change."""
        depth = stats.queue_depth if stats else 0
        if depth == dep.status.queue_depth:
            return
        patch = {"status": {"queueDepth": depth}}
        try:
            await self._kube.patch_status(
                LLM_DEPLOYMENTS, dep.namespace, dep.name, patch, FIELD_MANAGER_AUTOSCALER
            )
        except KubeError as exc:
            log.warning("%s: cannot write status.queueDepth: %s", dep.name, exc)

    def _scaler(
        self, dep: LLMDeployment, stats: dict[str, DeploymentStats] | None
    ) -> DeploymentAutoscaler:
        """The deployment's autoscaler, with this tick's targets and observing with this tick's
        gateway stats (None: the gateways could not be read, so their queue is unknown, never
        taken as zero)."""
        key = (dep.namespace, dep.name)
        scaler = self._scalers.get(key)
        selector, spec, name, namespace = dep.status.selector, dep.spec, dep.name, dep.namespace

        async def observe() -> Observation:
            pods = (await self._kube.list(PODS, namespace, selector)).items
            replicas = [r for r in map(replica_from_pod, pods) if r is not None]
            return await observe_deployment(
                client=self._http,
                gateway=stats.get(gateway_name(dep)) if stats is not None else None,
                gateway_known=stats is not None,
                replicas=replicas,
                engine_kind=spec.engine.kind,
                model_name=spec.model.name,
            )

        if scaler is None:
            scaler = DeploymentAutoscaler(
                gateway_name(dep),
                targets_from_spec(spec),
                observe,
                self._actuator(namespace),
                self._metrics,
                object_name=name,
            )
            self._scalers[key] = scaler
        else:
            scaler.targets = targets_from_spec(spec)  # the spec may have changed
            scaler.set_observe(observe)
        return scaler

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("autoscaler tick failed")
            await asyncio.sleep(interval_s)
