"""An adapter's `adapter_config.json` inside what the engines unpack: a URL's tar archive,
or an OCI artifact.

- An archive is read from its start, at most `ARCHIVE_SCAN_BYTES`: `tar czf` of a folder
  puts the small config anywhere, so one past that bound is left to the engine (unchecked)
  rather than downloading a whole adapter on every pass.
- An OCI artifact of files (ORAS) has the config as its own layer: the manifest, then that
  one blob (anonymous bearer token, as the engine pulls; `api.oci_reference`). A config
  packed inside an image layer is left to the engine.
Nothing read is echoed into a status (the endpoint is the adapter author's choice).
"""

from __future__ import annotations

import io
import json
import posixpath
import tarfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from servefleet.api.lora import ADAPTER_CONFIG, MAX_ADAPTER_CONFIG_BYTES
from servefleet.api.model_source import ModelSource, OciImageSource
from servefleet.api.oci_reference import (
    ACCEPT_MANIFESTS,
    MAX_MANIFEST_BYTES,
    bearer_challenge,
    config_layer,
    index_entry,
    parse_reference,
)
from servefleet.operator.adapter_config_read import ConfigRead, parse_config, status_result

ARCHIVE_SCAN_BYTES = 32 << 20
_ENGINE_CHECKS = "rank and target modules are checked by the engine when it loads the adapter"


class _Answer(Exception):
    """A definitive ConfigRead found midway (a status, a size), raised to the reader."""

    def __init__(self, result: ConfigRead) -> None:
        self.result = result


async def read_archive_config(client: httpx.AsyncClient, url: str) -> ConfigRead:
    where = f"{ADAPTER_CONFIG} in {url}"
    try:
        head, complete = await _read_head(client, url, ARCHIVE_SCAN_BYTES, where)
    except _Answer as answer:
        return answer.result
    except httpx.HTTPError as exc:
        return ConfigRead("retry", f"{where}: {type(exc).__name__}: {exc}")
    try:
        body = _config_member(head)
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        if not complete:  # cut off at the bound, mid-member
            return ConfigRead("unchecked", f"{where}: not in its first 32 MiB: {_ENGINE_CHECKS}")
        return ConfigRead("refused", f"{url}: not a readable tar archive ({exc})",
                          reason="InvalidAdapterArchive")  # fmt: skip
    if body is None:
        if not complete:
            return ConfigRead("unchecked", f"{where}: not in its first 32 MiB: {_ENGINE_CHECKS}")
        return ConfigRead("refused", f"{where}: the archive holds no {ADAPTER_CONFIG}",
                          reason="AdapterConfigNotFound")  # fmt: skip
    return parse_config(body, where)


def _config_member(head: bytes) -> bytes | None:
    """The config at the archive's root or one folder down (`tar czf a.tgz my-adapter/`)."""
    with tarfile.open(fileobj=io.BytesIO(head), mode="r|*") as tar:
        for member in tar:
            parts = member.name.strip("/").split("/")
            if parts[-1] != ADAPTER_CONFIG or len(parts) > 2 or not member.isfile():
                continue
            if member.size > MAX_ADAPTER_CONFIG_BYTES:
                raise ValueError(f"{member.name} is over {MAX_ADAPTER_CONFIG_BYTES} bytes")
            extracted = tar.extractfile(member)
            return extracted.read() if extracted is not None else None
    return None


async def read_oci_config(client: httpx.AsyncClient, oci: OciImageSource) -> ConfigRead:
    image = parse_reference(oci.reference)
    what = f"oci://{oci.reference}"
    source = ModelSource(oci=oci)
    headers = {"Accept": ACCEPT_MANIFESTS}
    try:
        manifest = await _manifest(client, f"{image.base_url}/manifests/{image.reference}",
                                   headers, what, source)  # fmt: skip
        entry = index_entry(manifest)
        if entry:
            manifest = await _manifest(client, f"{image.base_url}/manifests/{entry}", headers,
                                       what, source)  # fmt: skip
        layer = config_layer(manifest, oci.path)
        if layer is None:
            where = posixpath.join(oci.path, ADAPTER_CONFIG) if oci.path else ADAPTER_CONFIG
            return ConfigRead("unchecked", f"{what}: no layer titled {where} (packed in a "
                              f"layer): {_ENGINE_CHECKS}")  # fmt: skip
        url = f"{image.base_url}/blobs/{layer.get('digest', '')}"
        body, _ = await _read_head(client, url, MAX_ADAPTER_CONFIG_BYTES, what, headers, source)
    except _Answer as answer:
        return answer.result
    except httpx.HTTPError as exc:
        return ConfigRead("retry", f"{what}: {type(exc).__name__}: {exc}")
    return parse_config(body, f"{ADAPTER_CONFIG} in {what}")


async def _manifest(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], what: str, source: ModelSource
) -> dict[str, object]:
    body, complete = await _read_head(client, url, MAX_MANIFEST_BYTES, what, headers, source)
    try:
        manifest = json.loads(body) if complete else None
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict):
        raise _Answer(ConfigRead("refused", f"{what}: the manifest is not a JSON object",
                                 reason="AdapterNotReadable"))  # fmt: skip
    return manifest


async def _read_head(
    client: httpx.AsyncClient,
    url: str,
    limit: int,
    where: str,
    headers: dict[str, str] | None = None,
    source: ModelSource | None = None,
) -> tuple[bytes, bool]:
    """Up to `limit` bytes of `url` and whether that was all of it; a registry's bearer
    challenge is answered once (headers gains the token, for the next calls)."""
    async with _get(client, url, headers or {}, where, source) as response:
        body = bytearray()  # appended in place: up to 32 MiB in many chunks
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > limit:
                return bytes(body[:limit]), False
    return bytes(body), True


@asynccontextmanager
async def _get(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    where: str,
    source: ModelSource | None,
) -> AsyncIterator[httpx.Response]:
    for attempt in (1, 2):
        async with client.stream("GET", url, headers=headers) as response:
            challenge = bearer_challenge(response.headers.get("www-authenticate", ""))
            if response.status_code == 401 and attempt == 1 and challenge is not None:
                headers["Authorization"] = f"Bearer {await _token(client, challenge, where)}"
                continue
            if response.status_code != 200:
                fallback = source or ModelSource(url=url)
                raise _Answer(status_result(response.status_code, where, fallback))
            yield response
            return


async def _token(client: httpx.AsyncClient, challenge: dict[str, str], where: str) -> str:
    query = {k: v for k, v in challenge.items() if k in ("service", "scope")}
    answer = await client.get(challenge["realm"], params=query)
    if answer.status_code != 200:
        raise _Answer(status_result(answer.status_code, f"{where} (anonymous token)",
                                    ModelSource(url=challenge["realm"])))  # fmt: skip
    try:
        body = answer.json()
    except ValueError:
        body = None
    token = body.get("token") or body.get("access_token") if isinstance(body, dict) else None
    if not token:
        raise _Answer(ConfigRead("refused", f"{where}: the token answer holds no token",
                                 reason="AdapterNotReadable"))  # fmt: skip
    return str(token)
