"""An adapter from an OCI registry: an ORAS artifact of its files, or an image holding it.

Pulled over the registry's HTTP API (the OCI distribution spec: a manifest, then each layer's
blob by digest, with the anonymous bearer-token dance of Docker Hub, GHCR and Harbor).
Written by hand rather than with the `oras` package: that client has no request timeouts,
retries inside each call with blocking sleeps of minutes (hiding the failure from the
fetcher's own retry policy and progress lines), reads the host's Docker credentials (an
adapter author could then pick a registry the engine's host is logged in to), and does not
check blob digests. The tests push with `oras` to a real registry, so both sides of the
format are someone else's.

Layers, in manifest order:
- with an `org.opencontainers.image.title` annotation: one file of that name (ORAS's
  `oras push reg/a:v1 adapter_config.json adapter_model.safetensors`), or a folder (the
  tar+gzip ORAS makes of one, marked for unpacking by the Go client);
- without one: an image layer (a tar, maybe gzip), unpacked with its whiteouts.
`oci.path` then picks the PEFT folder inside. Registries on a loopback address are spoken
to in plain HTTP (as containerd does for localhost); every other one over HTTPS.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

from servefleet.api.lora import MAX_ADAPTER_BYTES, MAX_ADAPTER_FILES
from servefleet.api.model_source import OciImageSource
from servefleet.api.oci_reference import FOLDER_MEDIA_TYPE, TITLE, UNPACK, parse_reference
from servefleet.engine.fetch.errors import FetchError
from servefleet.engine.lora.registry_api import RegistryClient
from servefleet.engine.lora.unpack import UnpackBudget, clear_folder, publish_unpacked, unpack_tar

LAYERS_DIR = ".layers"
STAGING_DIR = ".staging"


class OciDownload:
    """One artifact or image into a PEFT folder."""

    def __init__(self, source: OciImageSource) -> None:
        self.source = source
        self.what = f"oci://{source.reference}"
        self._client = RegistryClient(parse_reference(source.reference), self.what)
        self._manifest: dict[str, Any] | None = None

    def _layers(self) -> list[dict[str, Any]]:
        if self._manifest is None:
            self._manifest = self._client.manifest()
        layers = self._manifest.get("layers")
        if not isinstance(layers, list) or not layers:
            raise FetchError(f"{self.what}: the manifest lists no layers", permanent=True)
        declared = sum(_size(layer) for layer in layers)
        if len(layers) > MAX_ADAPTER_FILES or declared > MAX_ADAPTER_BYTES:
            raise FetchError(
                f"{self.what}: {len(layers)} layers of {declared} bytes: too large to be an "
                "adapter",
                permanent=True,
            )
        return layers

    def total_bytes(self) -> int | None:
        return sum(_size(layer) for layer in self._layers())

    def run(self, folder: Path) -> None:
        blobs = folder / LAYERS_DIR
        blobs.mkdir(parents=True, exist_ok=True)
        clear_folder(folder, keep=LAYERS_DIR)
        staging = folder / STAGING_DIR
        budget = UnpackBudget()
        for layer in self._layers():
            blob = self._blob(layer, blobs)
            self._place(layer, blob, staging, budget)
        root = staging / self.source.path if self.source.path else staging
        if not root.is_dir():
            raise FetchError(
                f"{self.what}: no folder {self.source.path or '/'} in it (source.oci.path)",
                permanent=True,
            )
        publish_unpacked(root, folder)
        shutil.rmtree(staging)
        shutil.rmtree(blobs)

    def _blob(self, layer: dict[str, Any], blobs: Path) -> Path:
        """The layer's blob on disk, its sha256 checked (kept across a retry)."""
        digest = str(layer.get("digest", ""))
        algorithm, _, hexdigest = digest.partition(":")
        if algorithm != "sha256" or len(hexdigest) != 64 or not hexdigest.isalnum():
            raise FetchError(f"{self.what}: layer digest {digest!r} is not sha256", permanent=True)
        target = blobs / hexdigest
        if target.exists() and _sha256(target) == hexdigest:
            return target
        self._client.download_blob(digest, target, _size(layer))
        if _sha256(target) != hexdigest:
            target.unlink()
            raise FetchError(
                f"{self.what}: blob {digest} does not match its digest", permanent=False
            )
        return target

    def _place(
        self, layer: dict[str, Any], blob: Path, staging: Path, budget: UnpackBudget
    ) -> None:
        annotations = layer.get("annotations") or {}
        title = annotations.get(TITLE)
        if title is None:
            unpack_tar(blob, staging, f"{self.what} layer {layer['digest']}", budget)
            return
        name = PurePosixPath(str(title))
        if name.is_absolute() or ".." in name.parts or not name.parts:
            raise FetchError(
                f"{self.what}: layer title {title!r} leaves the folder", permanent=True
            )
        if annotations.get(UNPACK) == "true" or layer.get("mediaType") == FOLDER_MEDIA_TYPE:
            unpack_tar(blob, staging, f"{self.what} folder {title}", budget)
            return
        budget.files -= 1
        budget.bytes -= blob.stat().st_size
        if budget.files < 0 or budget.bytes < 0:
            raise FetchError(f"{self.what}: too large to be an adapter", permanent=True)
        target = staging.joinpath(*name.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(blob, target)


def _size(layer: dict[str, Any]) -> int:
    """A layer's declared size (the blob may not be longer)."""
    size = layer.get("size")
    if not isinstance(size, int) or size < 0:
        raise FetchError(f"layer {layer.get('digest')!r}: no valid size", permanent=True)
    return size


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
