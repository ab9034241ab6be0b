"""Who may talk to engine pods, and with what they run. Pure.

Engine pods serve without the gateway's keys and limits, so three fences keep the
gateway the only door: a NetworkPolicy (only the chart's gateway and autoscaler pods, found
by their labels *in the chart's namespace*, and any pod of the namespaces the admin names
for Prometheus, reach the engine port; a label a pod gives itself elsewhere admits
nothing), an engine API key from a Secret (the gateway sends it as a Bearer token; /health,
/ready and /metrics stay open for probes and scrapes), and a restricted securityContext:
every container non-root with a read-only root filesystem, no service-account token.
"""

from __future__ import annotations

import base64
import copy
import secrets
from dataclasses import dataclass
from typing import Any

from servefleet.api.api_model import SecretKeyRef
from servefleet.api.conventions import (
    CHART_COMPONENT_AUTOSCALER,
    CHART_COMPONENT_GATEWAY,
    ENGINE_KEY_SECRET_KEY,
    ENGINE_PORT_NAME,
    ENGINE_USER,
    LABEL_APP_COMPONENT,
    LABEL_APP_PART_OF,
    LABEL_NAMESPACE_NAME,
    PART_OF,
    SCRATCH_MOUNT,
    engine_key_secret_name,
)
from servefleet.api.engines import EngineAdapter
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.operator.pools import engine_pods_selector

ENGINE_KEY_BYTES = 32


def engine_key_ref(dep: LLMDeployment) -> SecretKeyRef:
    """The Secret key engine pods require: the spec's, else the one the operator creates."""
    named = dep.spec.engine.api_key_secret_ref
    if named is not None:
        return named
    return SecretKeyRef(name=engine_key_secret_name(dep.name), key=ENGINE_KEY_SECRET_KEY)


def engine_key_secret(dep: LLMDeployment, meta: dict[str, Any]) -> dict[str, Any] | None:
    """A Secret with a fresh random key, or None when the spec names its own Secret.

    Random, so not part of the rendered children: the handler creates it once when absent
    and never re-applies it (a re-apply would rotate the key under running pods).
    """
    if dep.spec.engine.api_key_secret_ref is not None:
        return None
    key = "sk-engine-" + secrets.token_urlsafe(ENGINE_KEY_BYTES)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "data": {ENGINE_KEY_SECRET_KEY: base64.b64encode(key.encode()).decode()},
    }


def engine_key_env(dep: LLMDeployment, adapter: EngineAdapter) -> list[dict[str, Any]]:
    """The key as the engine's env var (none when the user's own env sets that name)."""
    if any(var.name == adapter.api_key_env for var in dep.spec.engine.env):
        return []
    ref = engine_key_ref(dep)
    return [
        {
            "name": adapter.api_key_env,
            "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
        }
    ]


@dataclass(frozen=True)
class EnginePeers:
    """Who may reach engine pods besides nothing: the chart's namespace (its gateway and
    autoscaler pods) and the namespaces the admin names for Prometheus."""

    system_namespace: str
    metrics_namespaces: tuple[str, ...] = ()


def _chart_pods(component: str, namespace: str) -> dict[str, Any]:
    """The chart's pods of one component, in the chart's namespace only. The namespace is
    selected by `kubernetes.io/metadata.name`, which the API server sets and nobody else
    can, and only the platform admin may create pods there, so the labels cannot be forged."""
    return {
        "namespaceSelector": {"matchLabels": {LABEL_NAMESPACE_NAME: namespace}},
        "podSelector": {
            "matchLabels": {LABEL_APP_PART_OF: PART_OF, LABEL_APP_COMPONENT: component}
        },
    }


def network_policy(dep: LLMDeployment, meta: dict[str, Any], peers: EnginePeers) -> dict[str, Any]:
    """Ingress to the engine pods only from the gateway, the autoscaler, Prometheus and
    (servefleet engines) the deployment's own engines, which pull KV blocks from each other
    (`/internal/kv/export`, behind the same engine key). Disaggregated, the prefill pool's
    pods are fenced by the same policy and are among the deployment's own engines.

    Ingress only: engines still reach model sources and the kubelet still probes them.
    """
    sources = [
        _chart_pods(CHART_COMPONENT_GATEWAY, peers.system_namespace),
        _chart_pods(CHART_COMPONENT_AUTOSCALER, peers.system_namespace),
    ]
    own = engine_pods_selector(dep)
    if dep.spec.engine.kind == "servefleet":
        sources.append({"podSelector": copy.deepcopy(own)})
    if peers.metrics_namespaces:
        names = sorted(set(peers.metrics_namespaces))
        selector = {"key": LABEL_NAMESPACE_NAME, "operator": "In", "values": names}
        sources.append({"namespaceSelector": {"matchExpressions": [selector]}})
    ingress: list[dict[str, Any]] = [
        {"from": sources, "ports": [{"port": ENGINE_PORT_NAME, "protocol": "TCP"}]}
    ]
    disaggregated = dep.spec.disaggregation is not None and dep.spec.engine.kind != "servefleet"
    if disaggregated or dep.spec.engine.pods_per_replica() > 1:
        # vLLM's NIXL and SGLang's Mooncake/NIXL hand KV over on ports UCX or Mooncake pick
        # at run time (beside the side channel / bootstrap port), and the ranks of a replica
        # spanning pods meet on ports of their own (Ray, NCCL, gloo): the deployment's own
        # engines, and only they, reach each other on every port.
        ingress.append({"from": [{"podSelector": copy.deepcopy(own)}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {"podSelector": own, "policyTypes": ["Ingress"], "ingress": ingress},
    }


POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": ENGINE_USER,
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""The engine pod's securityContext: every engine kind runs as ENGINE_USER (vLLM's and
SGLang's images would run as root)."""

CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
}
"""Every engine-pod container's securityContext. What engines write (compile caches, HOME,
temporary files) goes to the scratch emptyDir at SCRATCH_MOUNT (`scratch_env`)."""

SCRATCH_ENV: dict[str, str] = {
    "HOME": SCRATCH_MOUNT,
    "XDG_CACHE_HOME": f"{SCRATCH_MOUNT}/.cache",
    # torch and getpass look the user up by name; ENGINE_USER has no passwd entry in
    # vLLM's and SGLang's images.
    "USER": "servefleet",
}


def scratch_env(dep: LLMDeployment) -> list[dict[str, Any]]:
    """HOME and caches in the scratch volume (a name the user's env sets is left to it)."""
    own = {var.name for var in dep.spec.engine.env}
    return [{"name": k, "value": v} for k, v in SCRATCH_ENV.items() if k not in own]
