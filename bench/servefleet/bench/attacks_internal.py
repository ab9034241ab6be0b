"""Attacks on what only the platform may use: the gateway's internal port (metrics that name
every tenant, deployment stats, the replica list that decides where prompts and the engine key
go). The attacker reaches the port but holds no internal key; a holder of the key still cannot
point a deployment at anything but an engine address the platform rendered."""

from __future__ import annotations

import httpx

from servefleet.bench.attack_common import AttackResult
from servefleet.bench.attack_stack import AttackStack
from servefleet.bench.fault_stack import DEPLOYMENT

HOSTILE_ENDPOINTS = {
    "attacker_port": "http://127.0.0.1:9",
    "file": "file:///etc/passwd",
    "gopher": "gopher://127.0.0.1:6379/_FLUSHALL",
    "metadata": "http://169.254.169.254:80",
    "userinfo": "http://user:secret@127.0.0.1:8000",
}


def internal_without_key(stack: AttackStack, result: AttackResult) -> None:
    """Internal port without the internal key: metrics, stats, replica list, usage report.

    Every internal path but /health needs the key; a non-ASCII key is a 401, not a 500."""
    base = stack.gateway.internal_url
    replicas = f"{base}/internal/deployments/{DEPLOYMENT}/replicas"
    update = {"endpoints": [HOSTILE_ENDPOINTS["attacker_port"]]}
    calls = {
        "GET /metrics": lambda h: httpx.get(base + "/metrics", headers=h),
        "GET /internal/deployments": lambda h: httpx.get(base + "/internal/deployments", headers=h),
        "POST replicas": lambda h: httpx.post(replicas, json=update, headers=h),
        # every tenant's usage and cost (chargeback): the platform team's alone
        "GET /internal/usage": lambda h: httpx.get(base + "/internal/usage", headers=h),
    }
    headers_by_kind = {
        "no key": {},
        "tenant key": {"authorization": "Bearer key-alpha"},
        "non-ASCII key": {"authorization": "Bearer clé".encode()},
    }
    for label, call in calls.items():
        for kind, headers in headers_by_kind.items():
            response = call(headers)
            result.figures[f"{label} ({kind})"] = response.status_code
            result.require(
                response.status_code == 401,
                f"{label} with {kind}: {response.status_code} {response.text[:120]}",
            )
            result.require(
                response.headers.get("content-type", "").startswith("application/json"),
                f"{label} with {kind}: not a JSON error",
            )
    served = httpx.get(base + "/internal/deployments", headers=stack.internal_headers()).json()
    endpoints = [
        r.get("url") for d in served if d["name"] == DEPLOYMENT for r in d.get("replicas", [])
    ]
    result.figures["replicas_after"] = endpoints
    result.outcome = (
        "every internal path 401 without the internal key (no key, tenant key, non-ASCII)"
    )


def hostile_replicas(stack: AttackStack, result: AttackResult) -> None:
    """Replica list set to file://, gopher://, 169.254.169.254, user:pw@ (with the key).

    Even with the internal key, a deployment's replicas are only http(s) engine addresses
    inside its allowed networks: no other scheme, no credentials, no metadata service."""
    base = stack.gateway.internal_url
    replicas = f"{base}/internal/deployments/{DEPLOYMENT}/replicas"
    for label, endpoint in HOSTILE_ENDPOINTS.items():
        if label == "attacker_port":
            continue
        response = httpx.post(
            replicas, json={"endpoints": [endpoint]}, headers=stack.internal_headers()
        )
        result.figures[label] = response.status_code
        result.require(
            response.status_code == 400, f"{endpoint}: {response.status_code} {response.text[:160]}"
        )
    stats = httpx.get(base + "/internal/deployments", headers=stack.internal_headers()).json()
    ready = next(d for d in stats if d["name"] == DEPLOYMENT).get("ready_replicas")
    result.figures["ready_replicas_after"] = ready
    result.require(ready == len(stack.engines), f"replicas changed: {ready} ready")
    result.outcome = (
        "file, gopher, link-local and credentialed endpoints refused (400); replicas unchanged"
    )
