"""The engine API key: referenced in routes, resolved from its Secret, sent to replicas.

Engine pods require a key (issue: replicas reachable in-cluster bypassed the gateway's keys
and limits); the gateway is the one caller that holds it.
"""

from __future__ import annotations

from typing import Any

import httpx
from pydantic import SecretStr

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    SecretValueRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.bench.fake_upstream import FakeBehaviour, FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway
from servefleet.gateway.route_merge import (
    ResolvedSecrets,
    SecretKeyPath,
    parse_route,
    referenced_secrets,
    resolve_route,
)
from tests.support.routes import ROUTE_KEY, signed_route

MOUNT = "/etc/servefleet/secrets"
KEY_PATH = SecretKeyPath("ns", "m-engine-key", "api-key")
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def route_configmap() -> dict[str, Any]:
    fragment = {
        "deployments": [
            {
                "name": "m",
                "model": "m",
                "service": {"namespace": "ns", "name": "m-engine"},
                "engine_api_key": {"file": f"{MOUNT}/ns/m-engine-key/api-key"},
            }
        ]
    }
    return signed_route("ns", "m-gateway-route", fragment)


def test_engine_key_is_a_value_reference_resolved_from_its_secret() -> None:
    route = parse_route(route_configmap(), ROUTE_KEY)
    tenant_refs, value_refs = referenced_secrets(route, MOUNT)
    assert (tenant_refs, value_refs) == (set(), {KEY_PATH})
    secrets = ResolvedSecrets(values={KEY_PATH: SecretStr("engine-secret")})
    config, warnings = resolve_route(route, secrets, MOUNT)
    assert warnings == []
    key = config.deployments[0].engine_api_key
    assert key is not None and key.read() == "engine-secret"


def test_deployment_waits_while_its_engine_key_is_missing() -> None:
    route = parse_route(route_configmap(), ROUTE_KEY)
    config, warnings = resolve_route(route, ResolvedSecrets(), MOUNT)
    assert config.deployments == []
    assert warnings == [
        "ns/m-gateway-route: engine key ns/m-engine-key[api-key] not found; not served yet"
    ]


def test_gateway_sends_the_engine_key_as_a_bearer_token() -> None:
    replica = FakeOpenAI(FakeBehaviour(require_key="engine-secret"))
    with serve_in_thread(replica) as url:
        config = GatewayConfig(
            tenants=[GatewayTenant(name="a", api_keys=[ApiKeyRef(sha256=hash_api_key("key-a"))])],
            deployments=[
                GatewayDeployment(
                    name="m",
                    model="m",
                    tenants=[TenantAccess(name="a")],
                    engine_api_key=SecretValueRef(value=SecretStr("engine-secret")),
                )
            ],
        )
        gateway = Gateway(config)
        gateway.set_replicas("m", [url], ready=[url])
        with serve_in_thread(gateway) as base:
            reply = httpx.post(
                base + "/v1/chat/completions",
                headers={"authorization": "Bearer key-a"},
                json=CHAT,
                timeout=30,
            )
    assert reply.status_code == 200, reply.text
    # The tenant's key stays at the gateway; the replica sees only the engine key.
    assert [h["authorization"] for h in replica.stats.headers] == ["Bearer engine-secret"]
