"""Adapters the engine fetches itself when asked to load them (Kubernetes: the gateway sends
an adapter's source as its lora_path, `servefleet.api.lora_source`): `hf://` and `s3://`
paths, downloaded with the model fetcher into the engine's cache, from real local servers (a
Hub-compatible file API, moto's S3); never the internet."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest

from servefleet.api.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from servefleet.api.lora_source import parse_remote_lora_path, remote_lora_path
from servefleet.api.model_source import ModelSource
from servefleet.bench.make_adapters import random_adapter
from servefleet.engine import lora_routes
from servefleet.engine.fetch import FetchError
from servefleet.engine.lora.remote import fetch_adapter
from servefleet.engine.process import BuiltEngine
from tests.support.engine_harness import running_engine
from tests.support.http_server import openai_client, serve_in_thread
from tests.support.model_servers import HubRepo, ModelFileServer, model_file_server, s3_server


@pytest.fixture(scope="module")
def adapter_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    folder = random_adapter(tmp_path_factory.mktemp("adapter") / "a", seed=21, rank=8)
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= set(files)
    return files


@pytest.fixture(scope="module")
def hub(adapter_files: dict[str, bytes]) -> Iterator[ModelFileServer]:
    repo = HubRepo(files={**adapter_files, "README.md": b"# not fetched"})
    with model_file_server(ModelFileServer(repos={"acme/support": repo})) as server:
        yield server


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite runs with HF_HUB_OFFLINE=1; these tests talk to the local Hub only."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)


def hf_path(server: ModelFileServer, repo: str = "acme/support") -> str:
    source = ModelSource.model_validate({"huggingface": {"repo": repo, "endpoint": server.url}})
    return remote_lora_path(source)


@pytest.mark.usefixtures("online")
def test_a_hub_adapter_is_fetched_once_into_the_cache(
    hub: ModelFileServer, adapter_files: dict[str, bytes], tmp_path: Path
) -> None:
    source = parse_remote_lora_path(hf_path(hub))
    assert source is not None
    folder = fetch_adapter(source, tmp_path)
    assert folder == tmp_path / source.fetched_path()
    fetched = {p.name for p in folder.iterdir() if not p.name.startswith(".")}  # hub metadata
    assert fetched == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}  # the PEFT files only: no README
    assert (folder / ADAPTER_WEIGHTS).read_bytes() == adapter_files[ADAPTER_WEIGHTS]
    asked = len(hub.requests)
    assert fetch_adapter(source, tmp_path) == folder
    assert len(hub.requests) == asked  # a cache hit asks nothing


@pytest.fixture(scope="module")
def s3(adapter_files: dict[str, bytes]) -> Iterator[str]:
    with s3_server() as endpoint:
        client = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id="test-key", aws_secret_access_key="test-secret",
        )  # fmt: skip
        for bucket, acl in (("public", "public-read"), ("private", "private")):
            client.create_bucket(Bucket=bucket, ACL=acl)
            for name, body in adapter_files.items():
                client.put_object(Bucket=bucket, Key=f"support/{name}", Body=body, ACL=acl)
        yield endpoint


def test_an_s3_adapter_is_fetched_unsigned_without_credentials(
    s3: str, adapter_files: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine pods hold no credentials for adapters: a public bucket is read unsigned, a
    private one is a clear, permanent error saying why."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    public = ModelSource.model_validate({"s3": {"url": "s3://public/support/", "endpoint": s3}})
    source = parse_remote_lora_path(remote_lora_path(public))
    assert source == public
    folder = fetch_adapter(source, tmp_path / "cache")
    assert (folder / ADAPTER_CONFIG).read_bytes() == adapter_files[ADAPTER_CONFIG]
    private = public.model_copy(
        update={"s3": public.s3.model_copy(update={"url": "s3://private/support/"})}  # type: ignore[union-attr]
    )
    with pytest.raises(FetchError) as caught:
        fetch_adapter(private, tmp_path / "cache")
    assert caught.value.permanent and "sent unsigned" in caught.value.message


# --------------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def built(smollm2: Any) -> Iterator[BuiltEngine]:
    with running_engine(smollm2, enable_lora=True, max_loras=2, max_lora_rank=8) as engine:
        yield engine


@pytest.fixture
def url(built: BuiltEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(lora_routes, "adapter_cache_root", lambda: tmp_path / "adapters")
    with serve_in_thread(built) as base:
        yield base


def load(url: str, name: str, path: str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path}
    return httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=120)


@pytest.mark.usefixtures("online")
def test_loading_an_hf_path_fetches_then_serves_the_adapter(
    url: str, hub: ModelFileServer, tmp_path: Path
) -> None:
    first = load(url, "support", hf_path(hub))
    assert first.status_code == 200, first.text
    assert first.json()["loaded"] is True and first.json()["rank"] == 8
    assert list((tmp_path / "adapters").iterdir())  # in the engine's cache
    cards = {m.id: m for m in openai_client(url).models.list().data}
    assert cards["support"].parent == "smollm2-135m-instruct"  # type: ignore[attr-defined]
    asked = len(hub.requests)
    again = load(url, "support", hf_path(hub))  # the same source: nothing to fetch or load
    assert again.status_code == 200 and again.json()["loaded"] is False
    assert len(hub.requests) == asked


@pytest.mark.usefixtures("online")
@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("hf://acme/absent", "acme/absent@main"),
        ("hf://acme/support?token=x", "unknown parameters ['token']"),
        ("s3://bucket/file.safetensors", "end it in '/'"),
    ],
)
def test_an_adapter_source_that_cannot_be_fetched_is_a_400_naming_it(
    url: str, hub: ModelFileServer, path: str, said: str
) -> None:
    path = path.replace("hf://acme/absent", hf_path(hub, "acme/absent"))
    response = load(url, "nope", path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_path" and said in error["message"]
