"""The internal port trusts nobody by default: every path but /health needs the internal key,
replica endpoints are plain http(s) addresses the platform allowed, and the command refuses to
serve the port without a key. Also the 405s of both ports."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    SecretValueRef,
    ServiceRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.bench.processes import serve_in_thread
from servefleet.cli.autoscaler_cmd import KeyProblem, internal_api_key
from servefleet.cli.main import main as cli_main
from servefleet.gateway.app import Gateway

KEY = "internal-key-0123456789"
INTERNAL = {"authorization": f"Bearer {KEY}"}
PROTECTED = [
    ("GET", "/metrics"),
    ("GET", "/internal/deployments"),
    ("POST", "/internal/deployments/local/replicas"),
    ("GET", "/internal/usage"),  # every tenant's usage and cost (chargeback)
    ("GET", "/internal/nope"),  # not even whether a path exists
]


def config(**kw: Any) -> GatewayConfig:
    return GatewayConfig(
        tenants=[GatewayTenant(name="a", api_keys=[ApiKeyRef(sha256=hash_api_key("key-a"))])],
        deployments=[
            GatewayDeployment(
                name="local",
                model="m",
                tenants=[TenantAccess(name="a")],
                allowed_replica_networks=["127.0.0.1/32"],
            ),
            GatewayDeployment(
                name="static",
                model="m2",
                endpoints=["http://10.1.2.3:8000", "http://engine-0:8000"],
                tenants=[TenantAccess(name="a")],
            ),
            GatewayDeployment(name="bare", model="m3", tenants=[TenantAccess(name="a")]),
            GatewayDeployment(
                name="kube",
                model="m4",
                service=ServiceRef(namespace="ns", name="svc"),
                tenants=[TenantAccess(name="a")],
            ),
        ],
        **kw,
    )


@pytest.fixture
def ports() -> Iterator[tuple[str, str]]:
    """(tenant base URL, internal base URL) of a gateway holding the internal key."""
    gateway = Gateway(config(internal_api_key=SecretValueRef(value=KEY)))
    with ExitStack() as stack:
        base = stack.enter_context(serve_in_thread(gateway))
        internal = stack.enter_context(serve_in_thread(gateway.internal, lifespan="off"))
        yield base, internal


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer key-a"},  # a tenant's key
        {"authorization": f"Bearer {KEY}x"},
        {"authorization": KEY},  # no scheme
        {"authorization": "Bearer clé".encode()},  # non-ASCII: compared as bytes
        {"authorization": "Bearer ключ".encode()},
    ],
)
def test_every_internal_path_but_health_needs_the_key(
    ports: tuple[str, str], headers: dict[str, Any]
) -> None:
    _, internal = ports
    for method, path in PROTECTED:
        r = httpx.request(method, internal + path, headers=headers, json={"endpoints": []})
        assert r.status_code == 401, (method, path, r.text)
        assert r.headers["content-type"] == "application/json"
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert "local" not in r.text and "tenant" not in r.text
    assert httpx.get(internal + "/health", headers=headers).status_code == 200


def test_the_key_opens_every_internal_path(ports: tuple[str, str]) -> None:
    _, internal = ports
    assert httpx.get(internal + "/metrics", headers=INTERNAL).status_code == 200
    stats = httpx.get(internal + "/internal/deployments", headers=INTERNAL).json()
    assert [s["name"] for s in stats] == ["local", "static", "bare", "kube"]
    assert httpx.get(internal + "/internal/nope", headers=INTERNAL).status_code == 404


def test_without_a_configured_key_only_health_answers() -> None:
    gateway = Gateway(config())
    with serve_in_thread(gateway.internal, lifespan="off") as internal:
        for method, path in PROTECTED:
            r = httpx.request(method, internal + path, headers=INTERNAL, json={"endpoints": []})
            assert r.status_code == 401 and "No internal API key" in r.json()["error"]["message"]
        assert httpx.get(internal + "/health").status_code == 200


def post_replicas(internal: str, deployment: str, endpoints: list[str]) -> httpx.Response:
    url = f"{internal}/internal/deployments/{deployment}/replicas"
    return httpx.post(url, json={"endpoints": endpoints}, headers=INTERNAL)


@pytest.mark.parametrize(
    "endpoint",
    [
        "file:///etc/passwd",
        "gopher://127.0.0.1:6379/_FLUSHALL",
        "http://user:secret@127.0.0.1:8000",
        "http://127.0.0.1:8000/v1",
        "http://127.0.0.1:8000?x=1",
        "http://127.0.0.1:8000#x",
        "http://127.0.0.1",  # no port
        "http://:8000",
        "http://169.254.169.254:80",  # outside 127.0.0.1/32
        "http://127.0.0.2:8000",
        "http://localhost:8000",  # a name resolves where nobody checked it
    ],
)
def test_a_replica_must_be_a_plain_address_in_the_allowed_networks(
    ports: tuple[str, str], endpoint: str
) -> None:
    _, internal = ports
    before = httpx.get(internal + "/internal/deployments", headers=INTERNAL).json()
    r = post_replicas(internal, "local", ["http://127.0.0.1:8001", endpoint])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "endpoints.1"
    after = httpx.get(internal + "/internal/deployments", headers=INTERNAL).json()
    assert after == before  # nothing was applied


def test_allowed_replica_updates(ports: tuple[str, str]) -> None:
    _, internal = ports
    r = post_replicas(internal, "local", ["http://127.0.0.1:8001", "https://127.0.0.1:8443/"])
    assert r.status_code == 200
    assert [x["endpoint"] for x in r.json()["replicas"]] == [
        "http://127.0.0.1:8001",
        "https://127.0.0.1:8443",
    ]
    # Unset networks: the static endpoints' own addresses and names, nothing else.
    ok = post_replicas(internal, "static", ["http://10.1.2.3:9000", "http://engine-0:8001"])
    assert ok.status_code == 200
    for endpoint in ("http://10.1.2.4:8000", "http://engine-1:8000", "http://127.0.0.1:8000"):
        assert post_replicas(internal, "static", [endpoint]).status_code == 400
    # No networks and no static endpoints: nothing may be pointed anywhere.
    assert post_replicas(internal, "bare", ["http://127.0.0.1:8000"]).status_code == 400
    assert post_replicas(internal, "bare", []).status_code == 200
    # Discovered from Kubernetes: never.
    assert post_replicas(internal, "kube", []).status_code == 409


def test_config_refuses_bad_static_endpoints_and_networks() -> None:
    for endpoint in ("file:///x", "http://h", "http://u:p@h:1", "http://h:1/v1"):
        with pytest.raises(ValueError, match="endpoint"):
            GatewayDeployment(name="d", model="m", endpoints=[endpoint])
    with pytest.raises(ValueError, match="not a CIDR"):
        GatewayDeployment(name="d", model="m", allowed_replica_networks=["10.0.0.0/33"])


def test_a_wrong_method_on_a_known_path_is_405_with_allow(ports: tuple[str, str]) -> None:
    base, internal = ports
    for url, method, allow in [
        (base + "/v1/chat/completions", "GET", "POST"),
        (base + "/v1/models", "POST", "GET"),
        (base + "/v1/models/m", "DELETE", "GET"),
        (base + "/health", "POST", "GET"),
        (internal + "/metrics", "POST", "GET"),
        (internal + "/internal/deployments/local/replicas", "GET", "POST"),
    ]:
        headers = INTERNAL if url.startswith(internal) else {}
        r = httpx.request(method, url, headers=headers)
        assert r.status_code == 405, (method, url, r.text)
        assert r.headers["allow"] == allow
        assert r.json()["error"]["code"] == "method_not_allowed"
    assert httpx.get(base + "/v1/nope").status_code == 404
    assert httpx.post(base + "/metrics").status_code == 404  # the internal port's, not here


def test_the_gateway_command_refuses_an_internal_port_without_a_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_file = tmp_path / "gateway.json"
    config_file.write_text(config().model_dump_json(exclude_none=True))
    argv = ["gateway", "--config", str(config_file), "--port", "0", "--internal-port", "0"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "internal_api_key" in err[0] and "--internal-api-key-file" in err[0]


def test_the_autoscaler_reads_the_key_from_a_file_or_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    assert internal_api_key(str(key_file), {}) == KEY
    assert internal_api_key(None, {"SERVEFLEET_INTERNAL_API_KEY": KEY}) == KEY
    missing = internal_api_key(None, {})
    assert isinstance(missing, KeyProblem) and "--internal-api-key-file" in missing.message
    assert isinstance(internal_api_key(str(tmp_path / "nope"), {}), KeyProblem)
