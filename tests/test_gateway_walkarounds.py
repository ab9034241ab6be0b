"""Limits a tenant cannot walk around: every prompt's answers are reserved, and the engine's
priority is the gateway's to set (from the tenant's traffic class), never the tenant's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    SecretValueRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.llmdeployment import SpilloverSpec, TenantLimits
from servefleet.bench.fake_upstream import FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway

TPM = 1000


def auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer key-{tenant}"}


class Rig:
    def __init__(self, base: str, engine: FakeOpenAI, vllm: FakeOpenAI, hosted: FakeOpenAI):
        self.base, self.engine, self.vllm, self.hosted = base, engine, vllm, hosted

    def post(self, tenant: str, body: dict[str, Any], path: str = "/v1/completions") -> Any:
        return httpx.post(self.base + path, headers=auth(tenant), json=body, timeout=30)


@pytest.fixture
def rig() -> Iterator[Rig]:
    with ExitStack() as stack:
        engine, vllm, hosted = FakeOpenAI(), FakeOpenAI(), FakeOpenAI()
        engine_url, vllm_url, hosted_url = (
            stack.enter_context(serve_in_thread(f)) for f in (engine, vllm, hosted)
        )
        access = [TenantAccess(name="inter"), TenantAccess(name="bulk", traffic_class="batch")]
        spill = SpilloverSpec.model_validate(
            {
                "enabled": True,
                "baseURL": hosted_url + "/v1",
                "model": "hosted",
                "apiKeySecretRef": {"name": "s", "key": "k"},
                "when": {"noReadyReplica": True},
            }
        )
        config = GatewayConfig(
            tenants=[
                GatewayTenant(
                    name=name,
                    api_keys=[ApiKeyRef(sha256=hash_api_key(f"key-{name}"))],
                    limits=TenantLimits(tokens_per_minute=TPM),
                )
                for name in ("inter", "bulk")
            ],
            deployments=[
                GatewayDeployment(name="ours", model="m", tenants=access),
                GatewayDeployment(name="vllm", model="v", tenants=access, engine_priority=False),
                GatewayDeployment(
                    name="hosted",
                    model="h",
                    tenants=access,
                    spillover=spill,
                    spillover_api_key=SecretValueRef(value="hosted-key"),
                ),
            ],
            internal_port=None,
        )
        gateway = Gateway(config)
        gateway.set_replicas("ours", [engine_url], ready=[engine_url])
        gateway.set_replicas("vllm", [vllm_url], ready=[vllm_url])
        yield Rig(stack.enter_context(serve_in_thread(gateway)), engine, vllm, hosted)


def test_every_prompt_times_n_is_reserved(rig: Rig) -> None:
    # 10 prompts x n=16 x 8 tokens = 1,280 completion tokens: over a 1,000 TPM limit however
    # it is split (this passed with 128 + the prompts reserved).
    body = {"model": "m", "prompt": ["hi"] * 10, "n": 16, "max_tokens": 8}
    refused = rig.post("inter", body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "request_too_large"
    assert "1290" in refused.json()["error"]["message"]  # 10 x "hi" (1 each) + 1,280
    assert not rig.engine.stats.requests
    # 3 prompts x n=2 x 50 = 300 completion tokens (+3 prompt): what admission held back
    # (the header tells what was left after the reservation).
    ok = rig.post("inter", {**body, "prompt": ["hi"] * 3, "n": 2, "max_tokens": 50})
    assert ok.status_code == 200, ok.text
    assert int(ok.headers["x-ratelimit-remaining-tokens"]) == TPM - 303


@pytest.mark.parametrize("priority", [-(10**30), 0, 1, "interactive", "batch", False])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_tenant_never_sets_the_priority(rig: Rig, priority: Any, path: str) -> None:
    body: dict[str, Any] = {"model": "m", "max_tokens": 2, "priority": priority}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    refused = rig.post("bulk", body, path)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "priority"
    assert not rig.engine.stats.requests


@pytest.mark.parametrize("stream", [False, True])
def test_the_gateway_sends_the_traffic_class_as_the_priority(rig: Rig, stream: bool) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream}
    for tenant in ("inter", "bulk"):
        for model in ("m", "v"):
            r = rig.post(tenant, {**chat, "model": model}, "/v1/chat/completions")
            assert r.status_code == 200, r.text
    inter, bulk = rig.engine.stats.requests
    assert "priority" not in inter  # interactive: the engine's default
    assert bulk["priority"] == "batch"
    assert all("priority" not in body for body in rig.vllm.stats.requests)  # not theirs
    # The hosted API never hears of it either.
    r = rig.post("bulk", {**chat, "model": "h"}, "/v1/chat/completions")
    assert r.status_code == 200 and r.headers["x-servefleet-route"] == "spillover"
    assert "priority" not in rig.hosted.stats.requests[0]


def test_the_gateway_documents_no_field_it_sets_itself(rig: Rig) -> None:
    document = httpx.get(rig.base + "/openapi.json").json()
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        schema = document["components"]["schemas"][name]
        assert schema["additionalProperties"] is False  # so a field not listed is refused
        assert "temperature" in schema["properties"]
        for field in ("priority", "return_token_ids", "resume_token_ids"):
            assert field not in schema["properties"], (name, field)
