"""An LLMAdapter's `adapter_config.json`, read by the operator when it is declared.

Only that one small file, over plain HTTP, without credentials: from a Hub repository
(`<endpoint>/<repo>/resolve/<revision>/adapter_config.json`) or an S3 folder (an anonymous
GET of `<prefix>adapter_config.json`). A PVC or an image cannot be read from here. The
answer is never echoed into a status (the endpoint is the adapter author's choice, so the
operator must not become a way to read what it can reach): only its parsed fields, or the
HTTP status and which field of the config was wrong.

Results are kept for `ttl` seconds per source (the drift-repair pass re-judges every adapter
every 30 s); a transient failure is not kept, so the next pass asks again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote

import httpx
from pydantic import ValidationError

from servefleet.api.lora import ADAPTER_CONFIG, MAX_ADAPTER_CONFIG_BYTES, PeftLoraConfig
from servefleet.api.model_source import ModelSource

HUB = "https://huggingface.co"
TIMEOUT = httpx.Timeout(10.0)

ReadState = Literal["read", "refused", "unchecked", "retry"]


@dataclass(frozen=True)
class ConfigRead:
    """What reading an adapter's config gave.

    read: `config` holds it; refused: it is missing or not a servable PEFT config (definitive);
    unchecked: the operator cannot read it (a volume, or no anonymous access) and the engine
    checks it at load; retry: a transient failure (network, 5xx), asked again next pass.
    """

    state: ReadState
    message: str = ""
    config: PeftLoraConfig | None = None
    reason: str = ""


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


def parse_config(body: bytes, where: str) -> ConfigRead:
    """The config in `body`, or why it is not one (field names only, never the values)."""
    try:
        config = PeftLoraConfig.model_validate(json.loads(body))
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, ValidationError):
            fields = sorted({".".join(str(p) for p in e["loc"]) or "(root)" for e in exc.errors()})
            detail = f"invalid fields: {', '.join(fields)}"
        else:
            detail = "not JSON"
        return ConfigRead("refused", f"{where}: not a PEFT adapter config ({detail})",
                          reason="InvalidAdapterConfig")  # fmt: skip
    return ConfigRead("read", config=config)


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
        url = config_url(source)
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
        try:
            # No credentials, no proxy or .netrc from the environment, a few redirects at most.
            async with httpx.AsyncClient(
                timeout=TIMEOUT,
                follow_redirects=True,
                max_redirects=3,
                trust_env=False,
                transport=self._transport,
            ) as client, client.stream("GET", url) as response:  # fmt: skip
                if response.status_code != 200:
                    return _status_result(response.status_code, where, source)
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


def _status_result(status: int, where: str, source: ModelSource) -> ConfigRead:
    """A non-200 answer: missing (refused), not readable without credentials (refused for a
    Hub repository, which the engines fetch without credentials too; unchecked for S3, which
    the engine pods may read with their own identity), or a transient failure."""
    if status == 404:
        return ConfigRead(
            "refused",
            f"{where}: not found (HTTP 404): check the repository, revision or prefix",
            reason="AdapterConfigNotFound",
        )
    if status in (401, 403):
        if source.s3 is not None:
            return ConfigRead(
                "unchecked",
                f"{where}: not readable without credentials (HTTP {status}): rank and target "
                "modules are checked by the engine when it loads the adapter",
            )
        return ConfigRead(
            "refused",
            f"{where}: not readable without credentials (HTTP {status}); the engines fetch "
            "adapters without credentials too: the repository must be public",
            reason="AdapterNotReadable",
        )
    if status >= 500 or status == 429:
        return ConfigRead("retry", f"{where}: HTTP {status}")
    return ConfigRead("refused", f"{where}: HTTP {status}", reason="AdapterNotReadable")
