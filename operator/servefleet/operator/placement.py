"""`spec.scheduling` and GPUs → the scheduling fields of the engine pod spec. Pure."""

from __future__ import annotations

from typing import Any

from servefleet.api.api_model import ApiModel
from servefleet.api.conventions import engine_selector
from servefleet.api.engine_resources import engine_resources
from servefleet.api.engine_spec import GPU_RESOURCE
from servefleet.api.llmdeployment import LLMDeployment

GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
"""GPU nodes are commonly tainted with the resource name; GPU pods tolerate it unasked."""


def _wire(model: ApiModel) -> Any:
    """A spec part as the Pod API spells it: camelCase, unset and empty fields left out."""
    return _pruned(model.to_wire())


def _pruned(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _pruned(v) for k, v in value.items() if v not in ({}, [])}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def _tolerations(dep: LLMDeployment) -> list[dict[str, Any]]:
    wanted = [_wire(t) for t in dep.spec.scheduling.tolerations]
    if engine_resources(dep.spec).gpus > 0 and GPU_TOLERATION not in wanted:
        wanted.append(dict(GPU_TOLERATION))
    return wanted


def _spread(dep: LLMDeployment) -> list[dict[str, Any]]:
    """Constraints as given; one without a labelSelector counts this deployment's pods."""
    out = []
    for constraint in dep.spec.scheduling.topology_spread_constraints:
        wire = _wire(constraint)
        wire.setdefault("labelSelector", {"matchLabels": engine_selector(dep.name)})
        out.append(wire)
    return out


def placement(dep: LLMDeployment) -> dict[str, Any]:
    """The pod spec fields saying where an engine pod may run (only those that are set)."""
    scheduling = dep.spec.scheduling
    fields: dict[str, Any] = {
        "nodeSelector": dict(sorted(scheduling.node_selector.items())),
        "tolerations": _tolerations(dep),
        "affinity": _wire(scheduling.affinity) if scheduling.affinity else None,
        "priorityClassName": scheduling.priority_class_name,
        "runtimeClassName": scheduling.runtime_class_name,
        "topologySpreadConstraints": _spread(dep),
    }
    return {name: value for name, value in fields.items() if value}
