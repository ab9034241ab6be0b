"""Who may talk to engine pods, and with what they run. Pure.

Engine pods serve without the gateway's keys and limits, so three fences keep the
gateway the only door: a NetworkPolicy (only the chart's gateway and autoscaler pods, and
pods labelled LABEL_ENGINE_CLIENT such as Prometheus, reach the engine port), an engine API
key from a Secret (the gateway sends it as a Bearer token; /health, /ready and /metrics stay
open for probes and scrapes), and a restricted securityContext like the chart's own pods.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from servefleet.api.api_model import SecretKeyRef
from servefleet.api.conventions import (
    CHART_COMPONENT_AUTOSCALER,
    CHART_COMPONENT_GATEWAY,
    ENGINE_KEY_SECRET_KEY,
    ENGINE_PORT_NAME,
    LABEL_APP_COMPONENT,
    LABEL_APP_PART_OF,
    LABEL_ENGINE_CLIENT,
    PART_OF,
    engine_key_secret_name,
    engine_selector,
)
from servefleet.api.engines import EngineAdapter
from servefleet.api.llmdeployment import LLMDeployment

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


def _peer(component: str) -> dict[str, Any]:
    """The chart's pods of one component, in any namespace (the chart's is not known here)."""
    return {
        "namespaceSelector": {},
        "podSelector": {
            "matchLabels": {LABEL_APP_PART_OF: PART_OF, LABEL_APP_COMPONENT: component}
        },
    }


def network_policy(dep: LLMDeployment, meta: dict[str, Any]) -> dict[str, Any]:
    """Ingress to the engine pods only from the gateway, the autoscaler and labelled clients.

    Ingress only: engines still reach model sources and the kubelet still probes them.
    """
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": engine_selector(dep.name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        _peer(CHART_COMPONENT_GATEWAY),
                        _peer(CHART_COMPONENT_AUTOSCALER),
                        {
                            "namespaceSelector": {},
                            "podSelector": {"matchLabels": {LABEL_ENGINE_CLIENT: "true"}},
                        },
                    ],
                    "ports": [{"port": ENGINE_PORT_NAME, "protocol": "TCP"}],
                }
            ],
        },
    }


def pod_security(adapter: EngineAdapter) -> dict[str, Any]:
    """The pod's securityContext: non-root where the image allows it, default seccomp."""
    context: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
    if adapter.run_as_user is not None:
        context |= {"runAsNonRoot": True, "runAsUser": adapter.run_as_user}
    return context


CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
"""Every engine-pod container's securityContext. The root filesystem stays writable:
engines write compile caches (Triton, torch) under their home directory."""
