"""KV transfer between engines: the names both sides and the gateway spell once.

The wire format, paths, headers, limits, metric names and the internal request field
`kv_transfer_params` (gateway → engine only: `stream_resume.INTERNAL_FIELDS` refuses it
from tenants). Standard library and pydantic only.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from servefleet.api.cache_salt import MAX_CACHE_SALT_CHARS
from servefleet.api.disaggregation import DEFAULT_THRESHOLD_TOKENS

MEDIA_TYPE = "application/x-servefleet-kv; v=1"
MAGIC = b"SFKV"
FINGERPRINT_HEADER = "x-servefleet-kv-fingerprint"
"""A puller sends its fingerprint with an export request, so a mismatch is a 409 before any
bytes move."""

INFO_PATH = "/internal/kv/info"
LOOKUP_PATH = "/internal/kv/lookup"
EXPORT_PATH = "/internal/kv/export"
IMPORT_PATH = "/internal/kv/import"

FINGERPRINT_MISMATCH = "kv_fingerprint_mismatch"
"""The 409's error code: the blocks were computed by another model, numerics or layout."""


# ---- limits
MAX_TRANSFER_BLOCKS = 8192
"""Blocks one lookup, export or import names at most (128k tokens at block size 16)."""
MAX_META_BYTES = 64 * 1024
"""A header's or a frame's JSON at most: far above a real one (16 token ids and 3 hashes)."""
MAX_LOOKUP_BODY_BYTES = 64 + MAX_TRANSFER_BLOCKS * 40
"""A lookup or export body: up to MAX_TRANSFER_BLOCKS 32-hex-digit hashes, quoted."""
MAX_SOURCES = 4
MAX_DEADLINE_S = 60.0
POOL_SHARE = 0.10
"""Blocks exports may pin and imports may stage at once, each, as a share of the pool, so
transfers can never take the blocks running sequences need."""
WINDOW_BLOCKS = 32
"""Blocks pinned or staged per engine-thread call: one copy of ~24 MB in float32 (SmolLM2)."""
MAX_PREFILL_EXPORTS = 4
"""Prefill-and-export streams (P/D) one engine runs at once; more get a 429 `prefill_busy`."""
MAX_PREFILL_BODY_BYTES = 64 + MAX_TRANSFER_BLOCKS * 16 * 8
"""A prefill-and-export body: up to MAX_TRANSFER_BLOCKS blocks of token ids."""
PREFILL_BUSY = "prefill_busy"

# ---- metrics
BLOCKS_METRIC = "servefleet_engine_kv_transfer_blocks_total"
BYTES_METRIC = "servefleet_engine_kv_transfer_bytes_total"
SECONDS_METRIC = "servefleet_engine_kv_transfer_seconds"
FALLBACKS_METRIC = "servefleet_engine_kv_import_fallbacks_total"
JOINED_METRIC = "servefleet_engine_kv_pulls_joined_total"  # waited for another's pull instead
DIRECTION_LABEL = "direction"  # export | import
OUTCOME_LABEL = "outcome"  # ok | partial | refused | failed
REASON_LABEL = "reason"  # why a pull fell back to recompute

Direction = Literal["export", "import"]
Outcome = Literal["ok", "partial", "refused", "failed"]

HexHash = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


def hash_hex(block_hash: int) -> str:
    return f"{block_hash:032x}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KVHashesRequest(_Strict):
    """`lookup` and `export`: block hashes in chain order (a prompt's, from its first block)."""

    hashes: list[HexHash] = Field(min_length=1, max_length=MAX_TRANSFER_BLOCKS)
    adapter_identity: int | None = None  # the chain's adapter (`LoraAdapter.identity`)


class KVPrefillRequest(_Strict):
    """`export` with `compute: true` (disaggregated P/D): run these tokens as a prefill-only
    sequence and stream each full block once the step that wrote it is done (blocks already
    cached at once). A trailing partial block is neither computed for export nor sent."""

    prompt_token_ids: list[int] = Field(min_length=1, max_length=MAX_TRANSFER_BLOCKS * 16)
    adapter: str | None = None  # the LoRA adapter's served name; None: the base model
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    compute: Literal[True]
    start_block: int = Field(default=0, ge=0)  # blocks before it are held by the caller


class KVTransferParams(_Strict):
    """Where a request's leading KV blocks come from before it is computed: pulled from
    engines that hold them (`kv_sources`), or computed for it by a prefill engine
    (`remote_prefill`, disaggregated P/D; vLLM spells it do_remote_prefill/remote_host)."""

    kv_sources: list[str] = Field(default_factory=list, max_length=MAX_SOURCES)
    remote_prefill: str | None = None  # a prefill engine's base URL
    prefill_threshold: int = Field(default=DEFAULT_THRESHOLD_TOKENS, ge=0)
    """Uncached prompt tokens below which the decode engine prefills itself."""
    deadline_s: float = Field(default=5.0, gt=0.0, le=MAX_DEADLINE_S)

    @model_validator(mode="after")
    def _some_source(self) -> KVTransferParams:
        if not self.kv_sources and self.remote_prefill is None:
            raise ValueError("name kv_sources or remote_prefill")
        return self
