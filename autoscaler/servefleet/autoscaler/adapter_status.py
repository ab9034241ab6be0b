"""Where each LLMAdapter is loaded: `status.loadedReplicas` and its `Loaded` condition.

The gateways know it (they load adapters on demand and refresh what each replica holds from
its `GET /v1/models`), and the autoscaler already reads every gateway each tick, so it writes
it, as it writes `status.queueDepth`: a merge patch with its own field manager, only when it
changed. The operator writes `Accepted` and keeps other conditions; this keeps `Accepted`.

`Loaded` is True while some replica holds the adapter; False with reason `LoadFailed` and the
engine's reason while its last load was refused; False `NotLoaded` otherwise (adapters load
on their first request, so that is normal, not an error). An adapter not accepted (refused,
or its deployment gone) is routed nowhere: both are removed, so `kubectl get` never shows
it loaded beside `Accepted=False` (the engines may still hold it until they evict it).

Both writers send a whole `conditions` list (a merge patch replaces lists), so each patch
carries the `resourceVersion` it was computed from: a write that crossed the other's is
refused (409) and recomputed from the new object, never written over it (`cluster`).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from servefleet.api.deployment_status import Condition
from servefleet.api.gateway_stats import DeploymentStats
from servefleet.api.llmadapter import ADAPTER_ACCEPTED, ADAPTER_LOADED, LLMAdapter


def loaded_condition(name: str, holders: list[str], stats: DeploymentStats) -> Condition:
    error = stats.adapter_load_errors.get(name)
    if error is not None:
        return Condition(type=ADAPTER_LOADED, status="False", reason="LoadFailed", message=error)
    if holders:
        return Condition(
            type=ADAPTER_LOADED,
            status="True",
            reason="Loaded",
            message=f"held by {len(holders)} replica(s)",
        )
    return Condition(
        type=ADAPTER_LOADED,
        status="False",
        reason="NotLoaded",
        message="held by no replica: loaded on its next request",
    )


def is_accepted(adapter: LLMAdapter) -> bool:
    """Whether the operator accepted the adapter (only then is it in a route)."""
    accepted = adapter.status.condition(ADAPTER_ACCEPTED)
    return accepted is not None and accepted.status == "True"


def forget_loaded_patch(adapter: LLMAdapter) -> dict[str, Any] | None:
    """The merge patch that removes `loadedReplicas` and `Loaded` from an adapter no route
    serves; None when it has neither."""
    if adapter.status.condition(ADAPTER_LOADED) is None and not adapter.status.loaded_replicas:
        return None
    others = [c.to_wire() for c in adapter.status.conditions if c.type != ADAPTER_LOADED]
    return {"status": {"loadedReplicas": None, "conditions": others}}


def adapter_status_patch(
    adapter: LLMAdapter, stats: DeploymentStats, pod_names: Mapping[str, str], now: str
) -> dict[str, Any] | None:
    """The merge patch that brings the adapter's status to what the gateways see; None when
    it is already there. A refused adapter is served nowhere: `forget_loaded_patch`."""
    if not is_accepted(adapter):
        return forget_loaded_patch(adapter)
    name = adapter.served_name
    holders = sorted(
        pod_names.get(r.endpoint, r.endpoint) for r in stats.replicas if name in r.adapters
    )
    condition = loaded_condition(name, holders, stats)
    old = adapter.status.condition(ADAPTER_LOADED)
    same = old is not None and (old.status, old.reason, old.message) == (
        condition.status,
        condition.reason,
        condition.message,
    )
    if same and adapter.status.loaded_replicas == holders:
        return None
    if same and old is not None:
        condition = old  # only the replicas changed: keep the transition time
    else:
        condition = condition.model_copy(update={"last_transition_time": now})
    others = [c for c in adapter.status.conditions if c.type != ADAPTER_LOADED]
    conditions = [c.to_wire() for c in [*others, condition]]
    return {"status": {"loadedReplicas": holders, "conditions": conditions}}


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
