"""Routes from ConfigMaps: only the operator's, only within their namespace, no SSRF.

A namespace team may write any ConfigMap in its namespace, so a route is served only when
the operator signed it and an LLMDeployment of that namespace owns it; its replicas come
only from a Service of that namespace; its tenants and deployments are scoped to it, so a
route of namespace `aaa-evil` can neither take another team's tenant or model name nor
change what that team's key reaches; and spill-over cannot point into the cluster.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from servefleet.api.conventions import ROUTE_GATEWAY_KEY
from servefleet.api.gateway_config import GatewayConfig, hash_api_key
from servefleet.gateway.app import Gateway
from servefleet.gateway.route_merge import (
    ResolvedSecrets,
    RouteError,
    SecretKeyPath,
    merge_routes,
    parse_route,
    resolve_route,
)
from servefleet.gateway.spill_guard import resolve_hosts, spill_problem
from tests.support.routes import ROUTE_KEY, signed_route

MOUNT = "/etc/servefleet/secrets"


def fragment(
    namespace: str, tenant: str, model: str, deployment: str = "chat", **extra: Any
) -> dict[str, Any]:
    """What the operator renders for one LLMDeployment with one tenant."""
    return {
        "tenants": [
            {
                "name": tenant,
                "api_keys": [{"source": {"file": f"{MOUNT}/{namespace}/keys/{tenant}"}}],
                "limits": {"requestsPerMinute": 10},
            }
        ],
        "deployments": [
            {
                "name": deployment,
                "model": model,
                "service": {"namespace": namespace, "name": f"{deployment}-engine"},
                "tenants": [{"name": tenant}],
                **extra,
            }
        ],
    }


def route(namespace: str, tenant: str, model: str, **extra: Any) -> dict[str, Any]:
    return signed_route(
        namespace, "chat-gateway-route", fragment(namespace, tenant, model, **extra)
    )


def reject_reason(configmap: dict[str, Any]) -> str:
    with pytest.raises(RouteError) as err:
        parse_route(configmap, ROUTE_KEY)
    return str(err.value)


def test_only_routes_the_operator_signed_are_served() -> None:
    good = route("team", "a", "m")
    assert parse_route(good, ROUTE_KEY).namespace == "team"

    unsigned = copy.deepcopy(good)
    del unsigned["metadata"]["annotations"]
    assert "unsigned" in reject_reason(unsigned)

    forged = signed_route("team", "chat-gateway-route", fragment("team", "a", "m"), key=b"x" * 32)
    assert "bad signature" in reject_reason(forged)

    edited = copy.deepcopy(good)  # a team member edits the operator's route
    edited["data"][ROUTE_GATEWAY_KEY] = edited["data"][ROUTE_GATEWAY_KEY].replace("10", "99999")
    assert "bad signature" in reject_reason(edited)

    copied = copy.deepcopy(good)  # the same signed data under another name or namespace
    copied["metadata"]["name"] = "copy-gateway-route"
    assert "bad signature" in reject_reason(copied)
    moved = copy.deepcopy(good)
    moved["metadata"]["namespace"] = "aaa-evil"
    assert "bad signature" in reject_reason(moved)

    orphan = copy.deepcopy(good)
    orphan["metadata"]["ownerReferences"] = []
    assert "not owned by an LLMDeployment" in reject_reason(orphan)
    reparented = copy.deepcopy(good)
    reparented["metadata"]["ownerReferences"][0]["uid"] = "uid-of-another-deployment"
    assert "bad signature" in reject_reason(reparented)


@pytest.mark.parametrize(
    ("extra", "complaint"),
    [
        ({"endpoints": ["http://169.254.169.254:80"]}, "static endpoints are not allowed"),
        ({"service": {"namespace": "kube-system", "name": "x"}}, "a Service of team"),
        ({"service": None}, "a Service of team"),
        ({"tokenizer": "/etc/passwd"}, "tokenizer must be a built-in model name"),
    ],
)
def test_replicas_only_from_a_service_of_the_routes_own_namespace(
    extra: dict[str, Any], complaint: str
) -> None:
    # Signed, so as if the operator had rendered it: the gateway still checks the sources.
    assert complaint in reject_reason(route("team", "a", "m", **extra))


def resolve(*configmaps: dict[str, Any]) -> list[tuple[Any, GatewayConfig]]:
    routes = [parse_route(c, ROUTE_KEY) for c in configmaps]
    digests = {
        SecretKeyPath(r.namespace, "keys", t.name): hash_api_key(f"{r.namespace}-{t.name}-key")
        for r in routes
        for t in r.config.tenants
    }
    return [(r, resolve_route(r, ResolvedSecrets(digests=digests), MOUNT)[0]) for r in routes]


def test_a_squatting_namespace_changes_nothing_for_the_real_team() -> None:
    """`aaa-evil` sorts first and names team-a's tenant and model: before, its route won the
    model name and the tenant, and team-a's route was rejected."""
    real = route("team-a", "team-a", "llama")
    squat = route("aaa-evil", "team-a", "llama")
    result = merge_routes(GatewayConfig(), resolve(real, squat))
    assert result.rejected == {}
    assert sorted(result.served) == ["aaa-evil/chat-gateway-route", "team-a/chat-gateway-route"]
    gateway = Gateway(result.config)
    table = gateway.table
    # Each key reaches its own namespace's deployment, under the model name it asked for.
    assert table.keys.tenant_for("Bearer team-a-team-a-key") == "team-a/team-a"
    assert table.keys.tenant_for("Bearer aaa-evil-team-a-key") == "aaa-evil/team-a"
    assert table.routes[("team-a/team-a", "llama")].pool.name == "team-a/chat"
    assert table.routes[("aaa-evil/team-a", "llama")].pool.name == "aaa-evil/chat"
    # Scoped names are what metrics and stats show: no series is shared.
    assert {s.name for s in gateway.deployment_stats()} == {"team-a/chat", "aaa-evil/chat"}
    # Limits are per scoped tenant: the squatter's requests count against its own windows.
    scopes = {s.key for s in table.routes[("team-a/team-a", "llama")].scopes}
    assert scopes == {"t:team-a/team-a"}


def test_within_a_namespace_a_model_name_is_served_once_per_tenant() -> None:
    first = route("team", "a", "m")
    second = signed_route("team", "two-gateway-route", fragment("team", "a", "m", "two"))
    result = merge_routes(GatewayConfig(), resolve(first, second))
    assert result.served == ["team/chat-gateway-route"]
    assert (
        "two deployments serve the same model name m" in result.rejected["team/two-gateway-route"]
    )


def test_a_routes_tenant_cannot_join_the_base_configs() -> None:
    base = GatewayConfig.model_validate(
        {"tenants": [{"name": "team/a", "api_keys": [{"sha256": hash_api_key("admin")}]}]}
    )
    result = merge_routes(base, resolve(route("team", "a", "m")))
    assert "belongs to the gateway's base config" in result.rejected["team/chat-gateway-route"]
    assert [k.sha256 for k in result.config.tenants[0].api_keys] == [hash_api_key("admin")]


SPILL: dict[str, Any] = {
    "spillover": {
        "enabled": True,
        "baseURL": "",
        "model": "gpt",
        "apiKeySecretRef": {"name": "spill", "key": "k"},
    },
    "spillover_api_key": {"file": f"{MOUNT}/team/spill/k"},
}


@pytest.mark.parametrize(
    ("url", "resolved", "allowed", "refused"),
    [
        ("https://api.openai.com/v1", {"api.openai.com": ["104.18.7.192"]}, [], None),
        ("http://169.254.169.254/latest/meta-data", {}, [], "169.254.169.254"),
        ("http://127.0.0.1:8090/internal", {}, [], "127.0.0.1"),
        ("http://[::ffff:169.254.169.254]/", {}, [], "169.254.169.254"),
        ("http://[::1]:8080/", {}, [], "::1"),
        ("http://10.96.0.10/v1", {}, [], "10.96.0.10"),
        ("http://100.64.0.1/v1", {}, [], "100.64.0.1"),  # shared address space (pod CIDRs)
        ("http://metadata.internal/v1", {"metadata.internal": ["169.254.169.254"]}, [], "is "),
        ("http://svc.ns.svc/v1", {"svc.ns.svc": ["8.8.8.8", "10.0.0.1"]}, [], "10.0.0.1"),
        ("http://nowhere.invalid/v1", {"nowhere.invalid": None}, [], "does not resolve"),
        ("http://user:pw@api.example.com/v1", {}, [], "credentials"),
        ("ftp://api.example.com/v1", {}, [], "http(s)"),
        # The admin's allow-list: a host name, or networks its addresses are in.
        ("http://llm.corp/v1", {"llm.corp": ["10.1.2.3"]}, ["llm.corp"], None),
        ("http://llm.corp/v1", {"llm.corp": ["10.1.2.3"]}, ["10.1.0.0/16"], None),
        ("http://llm.corp/v1", {"llm.corp": ["10.2.2.3"]}, ["10.1.0.0/16"], "10.2.2.3"),
    ],
)
def test_spill_over_targets_must_be_public_unless_the_admin_allows_them(
    url: str, resolved: dict[str, list[str] | None], allowed: list[str], refused: str | None
) -> None:
    problem = spill_problem(url, resolved, allowed)
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and refused in problem


def test_a_refused_spill_target_turns_spill_over_off() -> None:
    url = "http://169.254.169.254/latest"
    extra = copy.deepcopy(SPILL)
    extra["spillover"]["baseURL"] = url
    parsed = parse_route(route("team", "a", "m", **extra), ROUTE_KEY)
    secrets = ResolvedSecrets(
        digests={SecretKeyPath("team", "keys", "a"): hash_api_key("k")},
    )
    problems = {url: spill_problem(url, {}, []) or ""}
    config, warnings = resolve_route(parsed, secrets, MOUNT, problems)
    (deployment,) = config.deployments
    assert deployment.spillover is None and deployment.spillover_api_key is None
    assert warnings == []  # the route watch logs the refusal, once (not a missing Secret)


def test_names_are_resolved_when_the_route_loads() -> None:
    found = asyncio.run(resolve_hosts(["localhost", "127.0.0.1"]))
    assert set(found) == {"localhost"}  # literals are not looked up
    assert found["localhost"] and "is " in (
        spill_problem("http://localhost:8090/", found, []) or ""
    )
