"""The two pools of a disaggregated deployment, as the operator renders them. Pure.

Without `spec.disaggregation` there is one pool and nothing here changes a rendered object.
With it, the deployment's own engine Deployment (`<name>-engine`, the scale subresource)
is the decode pool and `<name>-prefill` (Deployment and headless Service) the prefill pool.
Prefill pods carry a component of their own (`COMPONENT_PREFILL_ENGINE`), so the decode
pool's selector, Service and status never count them; both carry the role labels
(`servefleet.io/role`, and llm-d's `llm-d.ai/role` so its tooling knows them).
"""

from __future__ import annotations

from typing import Any

from servefleet.api.conventions import (
    COMPONENT_ENGINE,
    COMPONENT_PREFILL_ENGINE,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    engine_object_name,
    engine_selector,
    prefill_selector,
)
from servefleet.api.disaggregation import LLMD_ROLE_LABEL, PREFILL_SUFFIX, ROLE_LABEL, Role
from servefleet.api.disaggregation_flags import role_env, role_ports
from servefleet.api.llmdeployment import LLMDeployment


def prefill_object_name(deployment: str) -> str:
    """Name of the prefill pool's Deployment and Service."""
    return deployment + PREFILL_SUFFIX


def decode_role(dep: LLMDeployment) -> Role | None:
    """The role of the deployment's own pool: decode when disaggregated, else none."""
    return "decode" if dep.spec.disaggregation is not None else None


def pool_name(dep: LLMDeployment, role: Role | None) -> str:
    return prefill_object_name(dep.name) if role == "prefill" else engine_object_name(dep.name)


def pool_selector(dep: LLMDeployment, role: Role | None) -> dict[str, str]:
    return prefill_selector(dep.name) if role == "prefill" else engine_selector(dep.name)


def pool_component(role: Role | None) -> str:
    return COMPONENT_PREFILL_ENGINE if role == "prefill" else COMPONENT_ENGINE


def pool_replicas(dep: LLMDeployment, role: Role | None) -> int:
    block = dep.spec.disaggregation
    if role == "prefill" and block is not None:
        return block.prefill.desired_replicas()
    return dep.spec.desired_replicas()


def pool_min_replicas(dep: LLMDeployment, role: Role | None) -> int:
    block = dep.spec.disaggregation
    if role == "prefill" and block is not None:
        return block.prefill.min_replicas
    return dep.spec.pool.min_replicas


def role_labels(role: Role | None) -> dict[str, str]:
    return {} if role is None else {ROLE_LABEL: role, LLMD_ROLE_LABEL: role}


def role_container_env(dep: LLMDeployment, role: Role | None) -> list[dict[str, Any]]:
    """The role's env as container env (a downward-API field where the engine needs the
    pod's own address); a name the user's env sets is left to it."""
    own = {var.name for var in dep.spec.engine.env}
    env: list[dict[str, Any]] = []
    for var in role_env(dep.spec, role):
        if var.name in own:
            continue
        if var.field_path is not None:
            env.append({"name": var.name, "valueFrom": {"fieldRef": {"fieldPath": var.field_path}}})
        else:
            env.append({"name": var.name, "value": var.value})
    return env


def role_container_ports(dep: LLMDeployment, role: Role | None) -> list[dict[str, Any]]:
    return [
        {"name": p.name, "containerPort": p.port, "protocol": "TCP"}
        for p in role_ports(dep.spec, role)
    ]


def engine_pods_selector(dep: LLMDeployment) -> dict[str, Any]:
    """Every engine pod of the deployment: the engine pool's, and the prefill pool's when
    disaggregated (one NetworkPolicy fences both)."""
    if dep.spec.disaggregation is None:
        return {"matchLabels": engine_selector(dep.name)}
    components = [COMPONENT_ENGINE, COMPONENT_PREFILL_ENGINE]
    return {
        "matchLabels": {LABEL_DEPLOYMENT: dep.name},
        "matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In", "values": components}],
    }
