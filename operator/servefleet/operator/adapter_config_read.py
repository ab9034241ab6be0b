"""What reading an LLMAdapter's `adapter_config.json` gave, whichever way it was read
(`adapter_config` over HTTP, `adapter_config_packed` inside an archive or an OCI artifact)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import ValidationError

from servefleet.api.lora import PeftLoraConfig
from servefleet.api.model_source import ModelSource

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


def status_result(status: int, where: str, source: ModelSource) -> ConfigRead:
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
