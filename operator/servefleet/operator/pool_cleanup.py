"""Removing the prefill pool (Deployment, Service, PodDisruptionBudget, ServiceMonitor) when
`spec.disaggregation` is deleted, and the engine workload of the other kind when replicas
change between one pod (a Deployment) and groups of pods (a LeaderWorkerSet, `groups`).

Server-side apply only adds and updates, and garbage collection only runs when the
LLMDeployment itself goes, so a pool the spec no longer declares is deleted here. Only
objects this LLMDeployment owns (its uid in their ownerReferences) are touched: a
Deployment someone else named `<name>-prefill` is left alone.
"""

from __future__ import annotations

from typing import Any

from servefleet.api.llmdeployment import LLMDeployment
from servefleet.kube import KubeClient
from servefleet.kube.resources import (
    DEPLOYMENTS,
    LEADER_WORKER_SETS,
    POD_DISRUPTION_BUDGETS,
    SERVICE_MONITORS,
    SERVICES,
)
from servefleet.operator.groups import is_group, pods_per_replica
from servefleet.operator.pools import pool_name, prefill_object_name

PREFILL_POOL_KINDS = (DEPLOYMENTS, SERVICES, POD_DISRUPTION_BUDGETS, SERVICE_MONITORS)
"""What the operator renders for a prefill pool (`render.children`), deleted with its block."""


def owned_by(obj: dict[str, Any] | None, dep: LLMDeployment) -> bool:
    refs = (obj or {}).get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == dep.metadata.uid for ref in refs)


async def remove_prefill_pool(client: KubeClient, dep: LLMDeployment) -> list[str]:
    """Delete the prefill pool's objects this deployment owns; what was deleted. (Without
    the ServiceMonitor API its read is a 404, i.e. nothing to delete.)"""
    name = prefill_object_name(dep.name)
    removed = []
    for resource in PREFILL_POOL_KINDS:
        if owned_by(await client.get(resource, dep.namespace, name), dep):
            await client.delete(resource, dep.namespace, name)
            removed.append(f"{resource.kind} {name}")
    return removed


async def remove_other_workload(client: KubeClient, dep: LLMDeployment) -> str | None:
    """Delete the engine workload of the kind the spec no longer renders (the Deployment once
    replicas are groups, the LeaderWorkerSet once they are single pods), if this deployment
    owns it; what was deleted. Without the LeaderWorkerSet API its read is a 404: nothing."""
    resource = DEPLOYMENTS if is_group(dep) else LEADER_WORKER_SETS
    name = pool_name(dep, None)
    if not owned_by(await client.get(resource, dep.namespace, name), dep):
        return None
    await client.delete(resource, dep.namespace, name)
    return f"{resource.kind} {name}"


async def missing_group_api(client: KubeClient, dep: LLMDeployment) -> str | None:
    """Why replicas of several pods cannot run here (no LeaderWorkerSet API), or None:
    nothing is applied then, so what runs keeps running."""
    if not is_group(dep) or await client.has_api(
        LEADER_WORKER_SETS.api_version, LEADER_WORKER_SETS.plural
    ):
        return None
    return (
        f"replicas of {pods_per_replica(dep)} pods (engine.tensorParallelSize x "
        "pipelineParallelSize) need the LeaderWorkerSet API (sigs.k8s.io/lws) installed"
    )
