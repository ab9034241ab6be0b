"""An LLMAdapter's `adapter_config.json`, read by the operator when it is declared.

Only that one small file, over plain HTTP, without credentials: from a Hub repository
(`<endpoint>/<repo>/resolve/<revision>/adapter_config.json`) or an S3 folder (an anonymous
GET of `<prefix>adapter_config.json`); from the head of a URL's archive or an OCI artifact's
config layer (`adapter_config_packed`). A PVC cannot be read from here. The
answer is never echoed into a status (the endpoint is the adapter author's choice, so the
operator must not become a way to read what it can reach): only its parsed fields, or the
HTTP status and which field of the config was wrong.

Results are kept for `ttl` seconds per source (the drift-repair pass re-judges every adapter
every 30 s); a transient failure is not kept, so the next pass asks again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from urllib.parse import quote

import httpx

from servefleet.api.lora import ADAPTER_CONFIG, MAX_ADAPTER_CONFIG_BYTES
from servefleet.api.model_source import ModelSource
from servefleet.operator.adapter_config_packed import read_archive_config, read_oci_config
from servefleet.operator.adapter_config_read import ConfigRead, parse_config, status_result

__all__ = ["AdapterConfigReader", "ConfigRead", "config_url", "parse_config"]

HUB = "https://huggingface.co"
TIMEOUT = httpx.Timeout(10.0)


def config_url(source: ModelSource) -> str | None:
    """Where the config of a Hub or S3 adapter folder is, or None (not readable over HTTP)."""
    if source.huggingface is not None:
        hub = source.huggingface
        base = (hub.endpoint or HUB).rstrip("/")
        return f"{base}/{hub.repo}/resolve/{quote(hub.revision, safe='')}/{ADAPTER_CONFIG}"
    if source.s3 is not None:
        s3 = source.s3
        key = quote(s3.key + ADAPTER_CONFIG, safe="/")
        if s3.endpoint is not None:
            return f"{s3.endpoint.rstrip('/')}/{s3.bucket}/{key}"
        region = s3.region or "us-east-1"
        return f"https://s3.{region}.amazonaws.com/{s3.bucket}/{key}"
    return None


class AdapterConfigReader:
    """Reads and remembers adapter configs; `transport` lets tests answer in process."""

    def __init__(
        self,
        ttl: float = 300.0,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self._transport = transport
        self._clock = clock
        self._known: dict[str, tuple[float, ConfigRead]] = {}

    async def read(self, source: ModelSource) -> ConfigRead:
        url = config_url(source) or source.url
        if source.oci is not None:
            url = f"oci://{source.oci.reference}?path={source.oci.path}"
        if url is None:
            return ConfigRead(
                "unchecked",
                f"source.{source.kind} cannot be read by the operator: rank and target modules "
                "are checked by the engine when it loads the adapter",
            )
        now = self._clock()
        known = self._known.get(url)
        if known is not None and now - known[0] < self.ttl:
            return known[1]
        result = await self._fetch(url, source)
        if result.state != "retry":
            self._known[url] = (now, result)
        return result

    async def _fetch(self, url: str, source: ModelSource) -> ConfigRead:
        where = f"{ADAPTER_CONFIG} at {url}"
        if source.url is not None or source.oci is not None:
            async with self._client() as client:
                if source.oci is not None:
                    return await read_oci_config(client, source.oci)
                return await read_archive_config(client, source.url or "")
        try:
            async with self._client() as client, client.stream("GET", url) as response:
                if response.status_code != 200:
                    return status_result(response.status_code, where, source)
                body = b""
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_ADAPTER_CONFIG_BYTES:
                        return ConfigRead("refused", f"{where}: larger than "
                                          f"{MAX_ADAPTER_CONFIG_BYTES} bytes: not an adapter "
                                          "config", reason="InvalidAdapterConfig")  # fmt: skip
        except httpx.HTTPError as exc:
            return ConfigRead("retry", f"{where}: {type(exc).__name__}: {exc}")
        return parse_config(body, where)

    def _client(self) -> httpx.AsyncClient:
        # No credentials, no proxy or .netrc from the environment, a few redirects at most.
        return httpx.AsyncClient(
            timeout=TIMEOUT,
            follow_redirects=True,
            max_redirects=3,
            trust_env=False,
            transport=self._transport,
        )
