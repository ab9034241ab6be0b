"""The operator reads the `adapter_config.json` of an adapter packed for the engines to
unpack: from the head of a URL's tar archive, and from an OCI artifact's config layer
(anonymous bearer token included), against a real file server and a real registry. Where
the config is out of reach (deep in a large archive, inside an image layer) the engine
checks it at load instead: never a refusal of an adapter that is fine."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from servefleet.api.model_source import ModelSource
from servefleet.operator.adapter_config import AdapterConfigReader
from tests.support.model_servers import ModelFileServer, model_file_server
from tests.support.oci_registry import oci_registry, push_image, push_with_oras, token_gate
from tests.test_operator_adapter_config import CONFIG


def tgz(members: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, body in members:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


CONFIG_BYTES = json.dumps(CONFIG).encode()
WEIGHTS = bytes(range(256)) * 4096
BIG = os.urandom(40 << 20)
"""Random bytes do not compress: 40 MiB of them before the config put it past the bound."""


@pytest.fixture(scope="module")
def files() -> Iterator[ModelFileServer]:
    served = {
        "a.tgz": tgz(
            [("a/adapter_model.safetensors", WEIGHTS), ("a/adapter_config.json", CONFIG_BYTES)]
        ),
        "bad.tgz": tgz([("adapter_config.json", json.dumps({"r": "x"}).encode())]),
        "none.tgz": tgz([("adapter_model.safetensors", WEIGHTS)]),
        "deep.tgz": tgz(
            [("adapter_model.safetensors", BIG), ("adapter_config.json", CONFIG_BYTES)]
        ),
        "junk.tgz": b"not an archive at all",
    }
    with model_file_server(ModelFileServer(files=served)) as server:
        yield server


@pytest.mark.parametrize(
    ("name", "state", "reason", "said"),
    [
        ("a.tgz", "read", "", ""),
        ("bad.tgz", "refused", "InvalidAdapterConfig", "invalid fields"),
        ("none.tgz", "refused", "AdapterConfigNotFound", "holds no adapter_config.json"),
        ("deep.tgz", "unchecked", "", "not in its first 32 MiB"),
        ("junk.tgz", "refused", "InvalidAdapterArchive", "not a readable tar archive"),
        ("absent.tgz", "refused", "AdapterConfigNotFound", "HTTP 404"),
    ],
)
async def test_an_archives_config_is_read_from_its_head(
    files: ModelFileServer, name: str, state: str, reason: str, said: str
) -> None:
    source = ModelSource.model_validate({"url": f"{files.url}/files/{name}"})
    got = await AdapterConfigReader().read(source)
    assert (got.state, got.reason) == (state, reason), got.message
    assert said in got.message
    if state == "read":
        assert got.config is not None and got.config.r == 8


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with oci_registry(tmp_path_factory.mktemp("registry")) as host:
        yield host


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("adapter")
    (path / "adapter_config.json").write_bytes(CONFIG_BYTES)
    (path / "adapter_model.safetensors").write_bytes(WEIGHTS)
    return path


def oci(reference: str, path: str = "") -> ModelSource:
    return ModelSource.model_validate({"oci": {"reference": reference, "path": path}})


async def test_an_oci_artifacts_config_layer_is_read_through_a_token_gate(
    registry: str, folder: Path
) -> None:
    push_with_oras(registry, "acme/support", "v1", sorted(folder.iterdir()))
    got = await AdapterConfigReader().read(oci(f"{registry}/acme/support:v1"))
    assert got.state == "read" and got.config is not None and got.config.r == 8
    with token_gate(registry) as (gate, asked):
        got = await AdapterConfigReader().read(oci(f"{gate}/acme/support:v1"))
    assert got.state == "read", got.message
    assert any(path.startswith("/token?") for path in asked)


async def test_an_image_or_a_missing_one_is_left_to_the_engine_or_refused(
    registry: str,
) -> None:
    image = push_image(
        registry, "acme/image", "v1", [tgz([("m/adapter_config.json", CONFIG_BYTES)])]
    )
    got = await AdapterConfigReader().read(oci(image, path="m"))
    assert got.state == "unchecked" and "checked by the engine" in got.message
    got = await AdapterConfigReader().read(oci(f"{registry}/acme/absent:v1"))
    assert (got.state, got.reason) == ("refused", "AdapterConfigNotFound"), got.message
