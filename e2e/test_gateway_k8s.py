"""The gateway on Kubernetes: routes from the operator's ConfigMaps, keys from Secrets, hot.

Against the real API server of `e2e/conftest.py`: the operator (chart ServiceAccount) renders
`<name>-gateway-route` from an LLMDeployment; `servefleet gateway --kube-routes` runs as a
process with a kubeconfig of the chart's *gateway* ServiceAccount (so its RBAC is proven),
reads the route and the tenant key Secret through the API server, and routes to an in-test
OpenAI stand-in that an EndpointSlice written here points at (there is no kubelet, so no
engine pod ever runs). Then the CR and the Secret change under the running gateway.

The first tests are pure (route parsing and merging rules; more in
tests/test_gateway_routes.py) and need no cluster.

    uv run pytest e2e/test_gateway_k8s.py
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import RELEASE, SYSTEM_NAMESPACE
from k8s.kube_gateway import KubeGateway, endpoint_slice, host_address, stand_in
from k8s.kubectl import Kube, OperatorProcess, wait_for

from servefleet.api.conventions import (
    ANNOTATION_ROUTE_SIGNATURE,
    ROUTE_GATEWAY_KEY,
    SECRETS_MOUNT,
)
from servefleet.api.gateway_config import GatewayConfig, RedisConfig, hash_api_key
from servefleet.api.route_signature import route_signature
from servefleet.gateway.app import Gateway
from servefleet.gateway.route_merge import (
    ResolvedSecrets,
    RouteError,
    SecretKeyPath,
    merge_routes,
    parse_route,
    referenced_secrets,
    resolve_route,
)

NAMESPACE = "e2e-gateway-routes"
NAME = "routed"
MODEL = "routed-model"
SECRET = "routed-keys"
KEY = "sk-routed-first-key"
ROTATED_KEY = "sk-routed-rotated-key"
MOUNT = SECRETS_MOUNT


# ----------------------------------------------------------------------------- pure rules


ROUTE_KEY = b"route-signing-key-for-the-pure-tests"


def route_configmap(namespace: str, name: str, config: dict[str, Any]) -> dict[str, Any]:
    """As the operator writes it: owned by an LLMDeployment, signed."""
    data = {ROUTE_GATEWAY_KEY: yaml.safe_dump(config)}
    owner = {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMDeployment",
        "name": name,
        "uid": "uid-1",
        "controller": True,
    }
    signature = route_signature(ROUTE_KEY, namespace, name, "uid-1", data)
    meta = {
        "namespace": namespace,
        "name": name,
        "ownerReferences": [owner],
        "annotations": {ANNOTATION_ROUTE_SIGNATURE: signature},
    }
    return {"metadata": meta, "data": data}


def parsed(namespace: str, name: str, config: dict[str, Any]) -> Any:
    return parse_route(route_configmap(namespace, name, config), ROUTE_KEY)


def fragment(
    tenant: str, model: str, key_file: str, rpm: int = 10, namespace: str = "a"
) -> dict[str, Any]:
    return {
        "tenants": [
            {
                "name": tenant,
                "api_keys": [{"source": {"file": key_file}}],
                "limits": {"requestsPerMinute": rpm},
            }
        ],
        "deployments": [
            {
                "name": f"{model}-{tenant}",
                "model": model,
                "service": {"namespace": namespace, "name": f"{model}-engine"},
                "tenants": [{"name": tenant}],
            }
        ],
    }


def test_routes_may_only_reference_secrets_of_their_own_namespace() -> None:
    own = parsed("a", "r", fragment("t", "m", f"{MOUNT}/a/keys/t"))
    assert referenced_secrets(own)[0] == {SecretKeyPath("a", "keys", "t")}
    for bad in (f"{MOUNT}/b/keys/t", "/etc/passwd", f"{MOUNT}/a/../b/keys", f"{MOUNT}/a/keys"):
        route = parsed("a", "r", fragment("t", "m", bad))
        with pytest.raises(RouteError):
            referenced_secrets(route)
    env = fragment("t", "m", "x")
    env["tenants"][0]["api_keys"] = [{"source": {"env": "SERVEFLEET_INTERNAL_KEY"}}]
    with pytest.raises(RouteError, match="Secret references"):
        referenced_secrets(parsed("a", "r", env))


def test_tenants_are_scoped_to_their_namespace_and_conflicts_reject_whole_routes() -> None:
    a = parsed("a", "r1", fragment("t", "m1", f"{MOUNT}/a/keys/t"))
    b = parsed("b", "r1", fragment("t", "m1", f"{MOUNT}/b/keys/t", namespace="b"))
    a2 = parsed("a", "r2", fragment("t", "m3", f"{MOUNT}/a/keys/u"))
    other_limits = parsed("a", "r3", fragment("t", "m4", f"{MOUNT}/a/keys/t", rpm=99))
    secrets = ResolvedSecrets(
        digests={
            SecretKeyPath("a", "keys", "t"): hash_api_key("key-a"),
            SecretKeyPath("a", "keys", "u"): hash_api_key("key-a2"),
            SecretKeyPath("b", "keys", "t"): hash_api_key("key-b"),
        }
    )
    resolved = [(r, resolve_route(r, secrets)[0]) for r in (b, a2, other_limits, a)]
    result = merge_routes(GatewayConfig(), resolved)
    # b's tenant "t" and model "m1" are b's own: they take nothing from namespace a.
    assert result.served == ["a/r1", "a/r2", "b/r1"]
    assert "limits differ" in result.rejected["a/r3"]
    tenants = {t.name: {k.sha256 for k in t.api_keys} for t in result.config.tenants}
    # Two routes of namespace a: one tenant with both keys; b's key was not added to it.
    assert tenants == {
        "a/t": {hash_api_key("key-a"), hash_api_key("key-a2")},
        "b/t": {hash_api_key("key-b")},
    }


def test_a_tenant_whose_secret_is_missing_is_left_out_not_fatal() -> None:
    route = parsed("a", "r", fragment("t", "m", f"{MOUNT}/a/keys/t"))
    config, warnings = resolve_route(route, ResolvedSecrets())
    assert config.tenants == [] and config.deployments[0].tenants == []
    assert warnings and "a/keys[t] not found" in warnings[0]
    assert merge_routes(GatewayConfig(), [(route, config)]).served == ["a/r"]


def _config(rpm: int, concurrency: int = 4, *, second: bool = False) -> GatewayConfig:
    tenant = {"name": "t", "api_keys": [{"sha256": hash_api_key("k")}], "limits": {}}
    deployment = {
        "name": "d",
        "model": "m",
        "endpoints": ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
        "pool": {"perReplicaConcurrency": concurrency},
        "tenants": [{"name": "t", "model_limits": {"requestsPerMinute": rpm}}],
    }
    extra = [{**deployment, "name": "d2", "model": "m2"}] if second else []
    return GatewayConfig.model_validate({"tenants": [tenant], "deployments": [deployment, *extra]})


def test_reconfigure_keeps_pools_and_limits_replaces_changed_pools_with_what_they_learned() -> None:
    gateway = Gateway(_config(rpm=10, second=True))
    pool = gateway.pools["d"]
    pool.set_replicas(list(pool.replicas.replicas), ready=["http://10.0.0.1:8000"])
    pool.service_time.update(3.5)
    gateway.metrics.for_tenant("t", "m2")
    gateway.render_metrics()
    assert 'model="m2"' in gateway.metrics.render().decode()

    gateway.reconfigure(_config(rpm=20))  # a tenant's limit changed; d2 removed
    assert gateway.pools["d"] is pool  # same queue, replicas and measurements
    route = gateway.table.routes[("t", "m")]
    assert [s.policy.requests_per_minute for s in route.scopes] == [20]
    assert "d2" not in gateway.pools and ("t", "m2") not in gateway.table.routes
    assert 'servefleet_gateway_in_flight{model="m2"}' not in gateway.render_metrics().decode()

    gateway.reconfigure(_config(rpm=20, concurrency=8))  # the pool itself changed
    replaced = gateway.pools["d"]
    assert replaced is not pool and replaced.replicas.cap == 8
    assert replaced.service_time.value == 3.5
    states = {e: r.state.value for e, r in replaced.replicas.replicas.items()}
    assert states == {"http://10.0.0.1:8000": "ready", "http://10.0.0.2:8000": "starting"}
    assert gateway.keys.tenant_for("Bearer k") == "t"

    redis = _config(rpm=20).model_copy(update={"redis": RedisConfig(url="redis://127.0.0.1:1/0")})
    with pytest.raises(ValueError, match="restart"):
        gateway.reconfigure(redis)
    assert gateway.pools["d"] is replaced  # a refused config changes nothing


# ----------------------------------------------------------------------------- the cluster


def llmdeployment(rpm: int) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "servefleet.io/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": NAME, "namespace": NAMESPACE},
            "spec": {
                "model": {"name": MODEL, "source": {"builtin": "smollm2-135m-instruct"}},
                "tenants": [
                    {
                        "name": "routed-tenant",
                        "apiKeySecretRef": {"name": SECRET, "key": "api-key"},
                        "limits": {"requestsPerMinute": rpm},
                    }
                ],
            },
        }
    )


def secret(key: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": SECRET, "namespace": NAMESPACE},
            "type": "Opaque",
            "data": {"api-key": base64.b64encode(key.encode()).decode()},
        }
    )


@pytest.fixture
def gateway(
    kube: Kube, installed_chart: Path, route_key_file: Path, tmp_path: Path
) -> Iterator[KubeGateway]:
    kubeconfig = kube.service_account_kubeconfig(
        SYSTEM_NAMESPACE, f"{RELEASE}-gateway", tmp_path / "gateway.kubeconfig"
    )
    process = KubeGateway(kubeconfig, route_key_file, tmp_path)
    try:
        yield process
    finally:
        process.stop()


def _ready(gateway: KubeGateway) -> bool:
    """/ready answers 200; a gateway still starting up (not listening yet) is not ready."""
    assert gateway.alive(), f"gateway died:\n{gateway.logs()[-4000:]}"
    try:
        return httpx.get(gateway.url + "/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _status(gateway: KubeGateway, key: str) -> int | None:
    return gateway.status(key, MODEL)


def test_gateway_serves_operator_routes_with_secret_keys_and_follows_changes(
    kube: Kube, operator: OperatorProcess, gateway: KubeGateway
) -> None:
    kube.kubectl("create", "namespace", NAMESPACE, check=False)
    kube.apply_text(secret(KEY))
    kube.apply_text(llmdeployment(rpm=100))
    route = wait_for(
        "the operator to render the route ConfigMap",
        lambda: kube.get("configmap", f"{NAME}-gateway-route", NAMESPACE),
        timeout=60,
    )
    assert KEY not in yaml.safe_dump(route)  # a reference, never the key
    address = host_address()
    with stand_in(address) as (_, port):
        kube.apply_text(yaml.safe_dump(endpoint_slice(NAMESPACE, f"{NAME}-engine", address, port)))

        wait_for("the gateway to sync routes", lambda: _ready(gateway), timeout=60)
        wait_for("a routed request to succeed", lambda: _status(gateway, KEY) == 200, timeout=60)
        answer = gateway.chat(KEY, MODEL)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-servefleet-route"] == "pool"
        assert answer.headers["x-ratelimit-limit-requests"] == "100"
        wrong = gateway.chat("sk-not-a-key", MODEL)
        assert wrong.status_code == 401
        assert wrong.json()["error"]["code"] == "invalid_api_key"
        pid = gateway.proc.pid

        # A limit changes in the CR: the operator re-renders, the gateway follows, hot.
        kube.apply_text(llmdeployment(rpm=600))
        wait_for(
            "the gateway to apply the new limit",
            lambda: gateway.chat(KEY, MODEL).headers.get("x-ratelimit-limit-requests") == "600",
            timeout=60,
        )
        # The key is rotated in its Secret: the new one works, the old one stops working.
        kube.apply_text(secret(ROTATED_KEY))
        wait_for("the rotated key to work", lambda: _status(gateway, ROTATED_KEY) == 200)
        assert gateway.chat(KEY, MODEL).status_code == 401
        assert gateway.alive() and gateway.proc.pid == pid  # never restarted

        # Deleting the CR garbage-collects the route; the tenant is gone from the gateway.
        kube.kubectl("delete", "llmd", NAME, "-n", NAMESPACE, "--wait=false")
        wait_for("the route to disappear", lambda: _status(gateway, ROTATED_KEY) == 401, timeout=90)
    logs = gateway.logs()
    assert "routes applied" in logs
    for key in (KEY, ROTATED_KEY):
        assert key not in logs, "a tenant key appeared in the gateway's log"
