"""Adapters from a URL (a tar archive of the PEFT folder) and from an OCI registry (an ORAS
artifact, or an image layer), fetched by the engine itself into its cache: from a real HTTP
file server and a real registry (`docker-registry`), pushed with the `oras` client; never the
internet. Hostile archives are refused by name and leave nothing in the cache."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from servefleet.api.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from servefleet.api.lora_source import parse_remote_lora_path, remote_lora_path
from servefleet.api.model_source import ModelSource
from servefleet.api.oci_reference import parse_reference
from servefleet.bench.make_adapters import random_adapter
from servefleet.engine.fetch import FetchError
from servefleet.engine.lora.remote import fetch_adapter, fetched_directory
from tests.support.http_server import openai_client
from tests.support.model_servers import ModelFileServer, model_file_server
from tests.support.oci_registry import oci_registry, push_image, push_with_oras, token_gate
from tests.test_lora_remote import built, url  # noqa: F401 (fixtures: an engine over HTTP)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_adapter(tmp_path_factory.mktemp("adapter") / "support", seed=5, rank=8)


def tar_of(entries: list[tuple[str, bytes | None, bytes]], gzip: bool = True) -> bytes:
    """A tar from (name, content or None for a folder, link target) entries."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz" if gzip else "w") as tar:
        for name, content, link in entries:
            info = tarfile.TarInfo(name)
            if link:
                info.type, info.linkname = tarfile.SYMTYPE, link.decode()
                tar.addfile(info)
            elif content is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return out.getvalue()


def folder_tar(adapter: Path, prefix: str, gzip: bool = True) -> bytes:
    entries: list[tuple[str, bytes | None, bytes]] = (
        [(prefix.rstrip("/"), None, b"")] if prefix else []
    )
    entries += [(prefix + p.name, p.read_bytes(), b"") for p in sorted(adapter.iterdir())]
    return tar_of(entries, gzip)


def same_files(folder: Path, adapter: Path) -> bool:
    names = {p.name for p in folder.iterdir()}
    return names == {p.name for p in adapter.iterdir()} and all(
        (folder / name).read_bytes() == (adapter / name).read_bytes() for name in names
    )


@pytest.fixture(scope="module")
def files(adapter: Path) -> Iterator[ModelFileServer]:
    served = {
        "support.tgz": folder_tar(adapter, "support/"),
        "flat.tar": folder_tar(adapter, "", gzip=False),
        "climbs.tar.gz": tar_of([("../outside.json", b"{}", b"")]),
        "absolute.tgz": tar_of([("/etc/adapter_config.json", b"{}", b"")]),
        "link.tgz": tar_of([(ADAPTER_CONFIG, None, b"/etc/passwd")]),
        "not-a-tar.tgz": b"just bytes",
    }
    with model_file_server(ModelFileServer(files=served)) as server:
        yield server


def url_source(server: ModelFileServer, name: str) -> ModelSource:
    source = parse_remote_lora_path(f"{server.url}/files/{name}")
    assert source is not None and source.url is not None
    return source


@pytest.mark.parametrize("name", ["support.tgz", "flat.tar"])
def test_an_archive_url_is_unpacked_into_the_cache_once(
    files: ModelFileServer, adapter: Path, tmp_path: Path, name: str
) -> None:
    source = url_source(files, name)
    folder = fetch_adapter(source, tmp_path)
    assert folder == fetched_directory(source, tmp_path)  # known before the fetch
    assert same_files(folder, adapter)  # one folder down or flat: the PEFT files themselves
    asked = len(files.requests)
    assert fetch_adapter(source, tmp_path) == folder
    assert len(files.requests) == asked  # a cache hit asks nothing


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("climbs.tar.gz", "../outside.json"),
        ("absolute.tgz", "/etc/adapter_config.json"),
        ("link.tgz", "links and devices are refused"),
        ("not-a-tar.tgz", "not a readable tar archive"),
        ("absent.tgz", "HTTP 404"),
    ],
)
def test_a_hostile_or_broken_archive_is_refused_and_leaves_nothing(
    files: ModelFileServer, tmp_path: Path, name: str, said: str
) -> None:
    source = url_source(files, name)
    with pytest.raises(FetchError) as caught:
        fetch_adapter(source, tmp_path / "cache")
    assert caught.value.permanent and said in caught.value.message
    assert not fetched_directory(source, tmp_path / "cache").exists()
    assert not (tmp_path / "outside.json").exists()


def test_a_lora_path_url_must_name_an_archive() -> None:
    with pytest.raises(ValueError, match="archive"):
        parse_remote_lora_path("https://example.com/adapter_model.safetensors")


# --------------------------------------------------------------------------- OCI


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with oci_registry(tmp_path_factory.mktemp("registry")) as host:
        yield host


def oci_source(reference: str, path: str = "") -> ModelSource:
    spec = ModelSource.model_validate({"oci": {"reference": reference, "path": path}})
    source = parse_remote_lora_path(remote_lora_path(spec))
    assert source == spec
    return source


def test_an_oras_artifact_of_the_files_is_pulled(
    registry: str, adapter: Path, tmp_path: Path
) -> None:
    reference = push_with_oras(registry, "acme/support", "v1", sorted(adapter.iterdir()))
    folder = fetch_adapter(oci_source(reference), tmp_path)
    assert same_files(folder, adapter)
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= {p.name for p in folder.iterdir()}


def test_an_oras_folder_and_an_image_layer_are_unpacked_at_their_path(
    registry: str, adapter: Path, tmp_path: Path
) -> None:
    folder_ref = push_with_oras(registry, "acme/folder", "v1", [adapter])  # one tar.gz layer
    pulled = fetch_adapter(oci_source(folder_ref, path=adapter.name), tmp_path)
    assert same_files(pulled, adapter)
    stale = tar_of([("models/support/stale.bin", b"old", b"")])
    layer = folder_tar(adapter, "models/support/")
    whiteout = tar_of([("models/support/.wh.stale.bin", b"", b"")])
    image_ref = push_image(registry, "acme/image", "v2", [stale, layer, whiteout])
    pulled = fetch_adapter(oci_source(image_ref, path="models/support"), tmp_path)
    assert same_files(pulled, adapter)  # the whiteout deleted the earlier layer's file


def test_an_oci_pull_that_cannot_succeed_is_a_named_permanent_error(
    registry: str, tmp_path: Path
) -> None:
    with pytest.raises(FetchError) as caught:
        fetch_adapter(oci_source(f"{registry}/acme/absent:v1"), tmp_path)
    assert caught.value.permanent and "HTTP 404" in caught.value.message
    hostile = push_image(registry, "acme/hostile", "v1", [tar_of([("../x", b"1", b"")])])
    with pytest.raises(FetchError, match=r"\.\./x"):
        fetch_adapter(oci_source(hostile), tmp_path)
    wrong_path = push_image(registry, "acme/other", "v1", [tar_of([("a/b", b"1", b"")])])
    with pytest.raises(FetchError, match=r"source\.oci\.path"):
        fetch_adapter(oci_source(wrong_path, path="models"), tmp_path)


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("ubuntu", ("registry-1.docker.io", "library/ubuntu", "latest")),
        ("acme/support:v1", ("registry-1.docker.io", "acme/support", "v1")),
        ("ghcr.io/acme/support:v1", ("ghcr.io", "acme/support", "v1")),
        ("localhost:5000/a/b", ("localhost:5000", "a/b", "latest")),
        ("reg.io/a@sha256:" + "0" * 64, ("reg.io", "a", "sha256:" + "0" * 64)),
    ],
)
def test_image_references_are_split_as_docker_does(text: str, parts: tuple[str, ...]) -> None:
    image = parse_reference(text)
    assert (image.registry, image.repository, image.reference) == parts
    assert image.scheme == ("http" if text.startswith("localhost") else "https")


# --------------------------------------------------------------------------- over HTTP


def test_archive_and_oci_adapters_answer_as_the_same_folder_does(
    url: str,  # noqa: F811 (the fixture imported above)
    files: ModelFileServer,
    registry: str,
    adapter: Path,
) -> None:
    reference = push_with_oras(registry, "acme/served", "v1", sorted(adapter.iterdir()))
    paths = {
        "from-folder": str(adapter),
        "from-url": f"{files.url}/files/support.tgz",
        "from-oci": f"oci://{reference}",
    }
    client = openai_client(url)
    answers = set()
    for name, path in paths.items():
        body = {"lora_name": name, "lora_path": path}
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=120)
        assert loaded.status_code == 200, loaded.text
        completion = client.completions.create(
            model=name, prompt="The weather today is", max_tokens=12, temperature=0
        )
        answers.add(completion.choices[0].text)
    base = client.completions.create(
        model="smollm2-135m-instruct", prompt="The weather today is", max_tokens=12, temperature=0
    )
    assert len(answers) == 1 and base.choices[0].text not in answers
    refused = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": "hostile", "lora_path": f"{files.url}/files/link.tgz"},
        timeout=60,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora_path"


def test_a_registry_asking_for_a_token_gets_an_anonymous_one(
    registry: str, adapter: Path, tmp_path: Path
) -> None:
    """Docker Hub, GHCR and Harbor answer 401 with a bearer challenge even for public
    repositories: the engine asks the realm for an anonymous token and sends it."""
    push_with_oras(registry, "acme/gated", "v1", sorted(adapter.iterdir()))
    with token_gate(registry) as (gate, asked):
        folder = fetch_adapter(oci_source(f"{gate}/acme/gated:v1"), tmp_path)
    assert same_files(folder, adapter)
    assert asked[:3] == ["/v2/acme/gated/manifests/v1", asked[1], "/v2/acme/gated/manifests/v1"]
    assert asked[1].startswith("/token?") and "scope=repository" in asked[1]


def test_a_source_larger_than_an_adapter_is_cut_off(
    files: ModelFileServer,
    registry: str,
    adapter: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An untrusted server may send more than any adapter holds, or more than the manifest
    declared: the download stops there, with a permanent error, instead of filling the disk."""
    from servefleet.engine.lora import archive_source
    from servefleet.engine.lora import oci_source as oci_module
    from servefleet.engine.lora.registry_api import RegistryClient

    monkeypatch.setattr(archive_source, "MAX_ADAPTER_BYTES", 4096)
    with pytest.raises(FetchError, match="larger than 4096 bytes") as caught:
        fetch_adapter(url_source(files, "support.tgz"), tmp_path / "a")
    assert caught.value.permanent
    reference = push_with_oras(registry, "acme/large", "v1", sorted(adapter.iterdir()))
    monkeypatch.setattr(oci_module, "MAX_ADAPTER_BYTES", 4096)
    with pytest.raises(FetchError, match="too large to be an adapter"):
        fetch_adapter(oci_source(reference), tmp_path / "b")
    client = RegistryClient(parse_reference(reference), reference)
    layer = max(client.manifest()["layers"], key=lambda layer: layer["size"])
    with pytest.raises(FetchError, match="larger than the 100 bytes its manifest declares"):
        client.download_blob(layer["digest"], tmp_path / "blob", 100)
