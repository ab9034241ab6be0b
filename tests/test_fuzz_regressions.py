"""What fuzzing the servers found, pinned over HTTP (ASGI) against the engine's and gateway's apps.

A JSON string with an unpaired UTF-16 surrogate escape (`"\\ud800"`) used to pass validation and
then crash the engine's tokenizer and the gateway's affinity hash: a plain-text 500 from both.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    TenantAccess,
    hash_api_key,
)
from servefleet.engine.server import build_app
from servefleet.engine.serving_state import ServingState
from servefleet.gateway.app import Gateway

LONG = "a" * 200  # long enough for the gateway's prefix-affinity hash
BODIES = [
    (
        "/v1/completions",
        b'{"model": "m", "prompt": "\\ud800' + LONG.encode() + b'", "max_tokens": 1}',
    ),
    (
        "/v1/chat/completions",
        b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "\\udfff'
        + LONG.encode()
        + b'"}]}',
    ),
]


def one_tenant_config() -> GatewayConfig:
    """Tenant `a` (key `key-a`) on deployment `d` of model `m`, its replica unreachable."""
    return GatewayConfig(
        tenants=[GatewayTenant(name="a", api_keys=[ApiKeyRef(sha256=hash_api_key("key-a"))])],
        deployments=[
            GatewayDeployment(
                name="d",
                model="m",
                endpoints=["http://127.0.0.1:9"],
                tenants=[TenantAccess(name="a")],
            )
        ],
    )


def _post(app: Any, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await client.post(path, content=body, headers=headers)

    return asyncio.run(send())


def _assert_openai_400(response: httpx.Response) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_unicode"


@pytest.mark.parametrize(("path", "body"), BODIES)
def test_the_gateway_refuses_a_lone_surrogate(path: str, body: bytes) -> None:
    config = one_tenant_config()
    response = _post(Gateway(config), path, body, {"authorization": "Bearer key-a"})
    _assert_openai_400(response)


@pytest.mark.parametrize(("path", "body"), BODIES)
def test_the_engine_refuses_a_lone_surrogate(path: str, body: bytes) -> None:
    rejected: list[int] = []
    engine = SimpleNamespace(metrics=SimpleNamespace(rejected=rejected.append))
    app = build_app(cast(ServingState, SimpleNamespace(api_key=None, engine=engine)))
    _assert_openai_400(_post(app, path, body, {}))
    assert rejected == [400]


def _get(app: Any, path: str) -> httpx.Response:
    async def send() -> httpx.Response:
        # The engine's framework re-raises a handled bug after answering (so it is logged).
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await client.get(path)

    return asyncio.run(send())


def _assert_openai_500(response: httpx.Response) -> None:
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("server_error", "internal_error")


def test_a_bug_in_the_gateway_is_an_openai_shaped_500(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*_: Any) -> None:
        raise RuntimeError("a bug")

    gateway = Gateway(GatewayConfig())
    monkeypatch.setattr(gateway, "_http", broken)
    _assert_openai_500(_get(gateway, "/health"))


def test_a_bug_in_the_engine_is_an_openai_shaped_500() -> None:
    """/health on an engine object lacking `is_healthy`: an AttributeError inside the route."""
    engine = SimpleNamespace(metrics=SimpleNamespace(rejected=lambda _: None))
    app = build_app(cast(ServingState, SimpleNamespace(api_key=None, engine=engine)))
    _assert_openai_500(_get(app, "/health"))
