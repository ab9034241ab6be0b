"""Removing the prefill pool when `spec.disaggregation` is deleted.

Server-side apply only adds and updates, and garbage collection only runs when the
LLMDeployment itself goes, so a pool the spec no longer declares is deleted here. Only
objects this LLMDeployment owns (its uid in their ownerReferences) are touched: a
Deployment someone else named `<name>-prefill` is left alone.
"""

from __future__ import annotations

from typing import Any

from servefleet.api.llmdeployment import LLMDeployment
from servefleet.kube import KubeClient
from servefleet.kube.resources import DEPLOYMENTS, SERVICES
from servefleet.operator.pools import prefill_object_name


def owned_by(obj: dict[str, Any] | None, dep: LLMDeployment) -> bool:
    refs = (obj or {}).get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == dep.metadata.uid for ref in refs)


async def remove_prefill_pool(client: KubeClient, dep: LLMDeployment) -> list[str]:
    """Delete the prefill Deployment and Service this deployment owns; what was deleted."""
    name = prefill_object_name(dep.name)
    removed = []
    for resource in (DEPLOYMENTS, SERVICES):
        if owned_by(await client.get(resource, dep.namespace, name), dep):
            await client.delete(resource, dep.namespace, name)
            removed.append(f"{resource.kind} {name}")
    return removed
