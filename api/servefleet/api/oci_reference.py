"""What an OCI reference and an adapter artifact's manifest mean, for the engine that pulls
an adapter (`engine.lora.oci_source`) and the operator that reads its config when it is
declared (`operator.adapter_config`): one definition of Docker's naming rules, the media
types and annotations, and the anonymous bearer-token challenge.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any

from servefleet.api.lora import ADAPTER_CONFIG

MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
ACCEPT_MANIFESTS = ", ".join(MANIFEST_TYPES + INDEX_TYPES)
TITLE = "org.opencontainers.image.title"
"""A layer that is one named file (or folder) of an ORAS artifact."""
UNPACK = "io.deis.oras.content.unpack"
FOLDER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
"""A titled layer of this type is a folder ORAS packed (the Python client marks it so; the
Go client also sets UNPACK)."""
MAX_MANIFEST_BYTES = 4 << 20
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
DOCKER_HUB = "registry-1.docker.io"
_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class ImageReference:
    """`registry/repository:tag` or `registry/repository@sha256:..`, split as Docker does."""

    registry: str
    repository: str
    reference: str

    @property
    def scheme(self) -> str:
        """Plain HTTP for a registry on a loopback address (as containerd does), else HTTPS."""
        if self.registry.startswith("["):
            host = self.registry[: self.registry.index("]") + 1]
        else:
            host = self.registry.split(":", 1)[0]
        return "http" if host in LOOPBACK_HOSTS else "https"

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.registry}/v2/{self.repository}"


def parse_reference(text: str) -> ImageReference:
    """Docker's rules: the first part is a registry when it has a '.' or ':' or is
    localhost; else Docker Hub (single names under `library/`); the tag defaults to latest."""
    name, at, digest = text.partition("@")
    first, slash, rest = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, rest
    else:
        registry, path = DOCKER_HUB, name if slash else f"library/{name}"
    repository, colon, tag = path.rpartition(":")
    if not colon or "/" in tag:
        repository, tag = path, "latest"
    return ImageReference(registry, repository, digest if at else tag)


def bearer_challenge(header: str) -> dict[str, str] | None:
    """The realm, service and scope of a `WWW-Authenticate: Bearer ..` answer; None for any
    other scheme (Basic: the registry wants credentials, which adapters are pulled without)."""
    scheme, _, params = header.partition(" ")
    fields = dict(_CHALLENGE.findall(params))
    if scheme.lower() != "bearer" or "realm" not in fields:
        return None
    return fields


def index_entry(manifest: dict[str, Any]) -> str | None:
    """The digest of the first manifest an index lists (adapter files have no platform);
    None when `manifest` is no index."""
    if manifest.get("mediaType") not in INDEX_TYPES and "manifests" not in manifest:
        return None
    entries = manifest.get("manifests") or []
    return str(entries[0]["digest"]) if entries else ""


def config_layer(manifest: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The layer that is the adapter's `adapter_config.json` under `path` (an ORAS artifact
    of files), or None when the config is inside a packed layer (read only by unpacking)."""
    wanted = posixpath.join(path, ADAPTER_CONFIG) if path else ADAPTER_CONFIG
    for layer in manifest.get("layers") or []:
        annotations = layer.get("annotations") or {}
        if annotations.get(TITLE) == wanted and layer.get("mediaType") != FOLDER_MEDIA_TYPE:
            return dict(layer)
    return None
