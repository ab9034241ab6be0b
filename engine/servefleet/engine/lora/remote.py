"""Adapters the engine fetches itself when asked to load them: `hf://`, `s3://`, `oci://` and
http(s) archive lora paths.

On Kubernetes the gateway sends an adapter's source as its `lora_path`
(`servefleet.api.lora_source`): engine pods are never re-rolled to mount an adapter. The
folder is downloaded with the model fetcher (`servefleet.engine.fetch`: the same cache layout,
lock and atomic publish, the same progress lines on stdout) into `<cache>/adapters`, the
engine's own cache (`SERVEFLEET_CACHE_DIR`, the pod's scratch volume), once per pod; a
second load of the same source is a cache hit. Without credentials: the engine pods hold
none for adapters (boto3 uses the pod's own identity, or sends unsigned requests).
"""

from __future__ import annotations

from pathlib import Path

from servefleet.api.model_source import ModelSource
from servefleet.engine.fetch import fetch_model
from servefleet.engine.fetch.fetcher import Download, download_for_source
from servefleet.engine.model.conversion_cache import default_cache_root

ADAPTER_CACHE_DIR = "adapters"


def adapter_cache_root() -> Path:
    """Where fetched adapters live (read at each load, so the variable may change)."""
    return default_cache_root() / ADAPTER_CACHE_DIR


def fetched_directory(source: ModelSource, cache_root: Path) -> Path:
    """The folder a fetch of `source` lands in (known before it is fetched): an archive or an
    artifact is unpacked into its cache entry."""
    if source.url is not None or source.oci is not None:
        return cache_root / source.cache_entry()
    return cache_root / source.fetched_path()


def adapter_download(source: ModelSource) -> Download:
    """How an adapter source is fetched: a URL is an archive to unpack, an OCI reference an
    artifact to pull; Hub and S3 folders as models are."""
    if source.url is not None:
        from servefleet.engine.lora.archive_source import ArchiveDownload

        return ArchiveDownload(source.url)
    if source.oci is not None:
        from servefleet.engine.lora.oci_source import OciDownload

        return OciDownload(source.oci)
    return download_for_source(source)


def fetch_adapter(source: ModelSource, cache_root: Path) -> Path:
    """Download `source` unless the cache has it; raises `FetchError` (slow: call it off the
    event loop)."""
    fetched = fetched_directory(source, cache_root).relative_to(cache_root)
    return fetch_model(
        source, cache_root, download_for=adapter_download, fetched_path=str(fetched)
    ).path
