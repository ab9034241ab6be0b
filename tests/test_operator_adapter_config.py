"""The operator reads an LLMAdapter's `adapter_config.json` itself, over HTTP and without
credentials, from real local servers: a Hub-compatible file API and moto's S3. What the
server answered is never echoed into a status (only its fields' names and the HTTP status)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import boto3
import httpx
import pytest

from servefleet.api.model_source import ModelSource
from servefleet.operator.adapter_config import AdapterConfigReader
from tests.support.model_servers import HubRepo, ModelFileServer, model_file_server, s3_server

CONFIG = {
    "peft_type": "LORA",
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "v_proj"],
    "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "task_type": "CAUSAL_LM",  # PEFT writes more fields than we read
}
SECRET_LOOKING = "do-not-echo-0123456789"


@pytest.fixture(scope="module")
def hub() -> Iterator[ModelFileServer]:
    config = json.dumps(CONFIG).encode()
    state = ModelFileServer(
        repos={
            "acme/support": HubRepo(files={"adapter_config.json": config}),
            "acme/private": HubRepo(files={"adapter_config.json": config}, token="hf_x"),
            "acme/empty": HubRepo(files={"README.md": b"#"}),
            "acme/broken": HubRepo(
                files={"adapter_config.json": json.dumps({"r": SECRET_LOOKING}).encode()}
            ),
            "acme/not-json": HubRepo(files={"adapter_config.json": SECRET_LOOKING.encode()}),
            "acme/huge": HubRepo(files={"adapter_config.json": b" " * (2 << 20)}),
        }
    )
    with model_file_server(state) as server:
        yield server


def hub_source(server: ModelFileServer, repo: str) -> ModelSource:
    return ModelSource.model_validate({"huggingface": {"repo": repo, "endpoint": server.url}})


async def test_a_hub_adapters_config_is_read_once_per_ttl(hub: ModelFileServer) -> None:
    reader = AdapterConfigReader(ttl=300)
    got = await reader.read(hub_source(hub, "acme/support"))
    assert got.state == "read" and got.config is not None
    assert (got.config.r, got.config.target_modules) == (8, ("q_proj", "v_proj"))
    assert hub.requests[-1][1] == "/acme/support/resolve/main/adapter_config.json"
    asked = len(hub.requests)
    assert (await reader.read(hub_source(hub, "acme/support"))) == got
    assert len(hub.requests) == asked  # remembered: the drift pass does not ask each time


@pytest.mark.parametrize(
    ("repo", "reason", "said"),
    [
        ("acme/private", "AdapterNotReadable", "HTTP 401"),
        ("acme/empty", "AdapterConfigNotFound", "HTTP 404"),
        ("acme/absent", "AdapterConfigNotFound", "HTTP 404"),
        ("acme/broken", "InvalidAdapterConfig", "invalid fields: lora_alpha, r, target_modules"),
        ("acme/not-json", "InvalidAdapterConfig", "not JSON"),
        ("acme/huge", "InvalidAdapterConfig", "larger than"),
    ],
)
async def test_an_unreadable_or_invalid_config_is_refused_with_why(
    hub: ModelFileServer, repo: str, reason: str, said: str
) -> None:
    got = await AdapterConfigReader().read(hub_source(hub, repo))
    assert (got.state, got.reason) == ("refused", reason), got.message
    assert said in got.message and repo in got.message
    assert SECRET_LOOKING not in got.message


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    keys = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret"}
    with s3_server() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **{
            k.lower(): v for k, v in keys.items()
        })  # fmt: skip
        client.create_bucket(Bucket="adapters", ACL="public-read")  # anyone may list and read
        client.put_object(Bucket="adapters", Key="support/adapter_config.json",
                          Body=json.dumps(CONFIG).encode(), ACL="public-read")  # fmt: skip
        client.create_bucket(Bucket="private")
        client.put_object(Bucket="private", Key="support/adapter_config.json",
                          Body=json.dumps(CONFIG).encode())  # fmt: skip
        yield endpoint


def s3_source(endpoint: str, url: str) -> ModelSource:
    return ModelSource.model_validate({"s3": {"url": url, "endpoint": endpoint}})


async def test_an_s3_adapters_config_is_read_without_credentials(
    s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)  # the operator holds none, and sends none
    got = await AdapterConfigReader().read(s3_source(s3, "s3://adapters/support/"))
    assert got.state == "read" and got.config is not None and got.config.r == 8
    missing = await AdapterConfigReader().read(s3_source(s3, "s3://adapters/absent/"))
    assert missing.reason == "AdapterConfigNotFound"


async def test_a_private_bucket_is_left_to_the_engine(s3: str) -> None:
    """The engine pods may read it with their own identity; the operator cannot tell."""
    got = await AdapterConfigReader().read(s3_source(s3, "s3://private/support/"))
    assert got.state == "unchecked" and "HTTP 403" in got.message
    assert "checked by the engine" in got.message


async def test_a_volume_is_never_asked_and_a_network_failure_is_asked_again() -> None:
    calls: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(str(request.url))
        if len(calls) == 1:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json=CONFIG)

    reader = AdapterConfigReader(transport=httpx.MockTransport(answer))
    pvc: dict[str, Any] = {"pvc": {"claimName": "adapters", "path": "a"}}
    unchecked = await reader.read(ModelSource.model_validate(pvc))
    assert unchecked.state == "unchecked" and calls == []
    source = ModelSource.model_validate({"huggingface": {"repo": "acme/support"}})
    first = await reader.read(source)
    assert first.state == "retry" and "ConnectError" in first.message
    assert (await reader.read(source)).state == "read"  # not remembered: asked again
    assert calls == ["https://huggingface.co/acme/support/resolve/main/adapter_config.json"] * 2
