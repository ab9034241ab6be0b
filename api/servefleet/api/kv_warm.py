"""Scale-up warm start: a new engine pulls its peers' hottest prefixes before it is ready.

While it warms, the engine's `/ready` answers 503 with detail `kv-warming`. The gateway's
readiness prober, seeing that detail, POSTs `warm` to it once, naming the pool's ready
replicas as sources (none: the first replica of a pool, which then is ready at once). The
engine asks each source's `hot` list, pulls those chains (`kv_transfer` export, the same
verified wire) within `max_blocks` and `deadline_s`, then reports ready. Without a warm call
it is ready after `--kv-warm-start-seconds` anyway, so a cold start grows by at most that
bound. Both paths sit behind the engine key; sources are checked as `kv_sources` are
(`--kv-peer-networks`). The three sizes are the deployment's `spec.kvWarmStart`
(`KVWarmStartSpec`): the bound goes to the engine as its flag, the blocks and deadline to
the gateway's warm call. Pydantic and `servefleet.api` only.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from servefleet.api.api_model import ApiModel
from servefleet.api.engine_flags import engine_flag
from servefleet.api.kv_transfer import MAX_DEADLINE_S, MAX_SOURCES, MAX_TRANSFER_BLOCKS, HexHash

WARM_PATH = "/internal/kv/warm"
HOT_PATH = "/internal/kv/hot"
WARMING_DETAIL = "kv-warming"
"""`/ready`'s 503 detail while the engine may still be warmed (the gateway's cue)."""

WARM_START_SECONDS = 10.0
"""`--kv-warm-start-seconds` of the engines the platform starts (operator, local mode) unless
`spec.kvWarmStart.seconds` says otherwise: the most a cold start grows while waiting for the
gateway's warm call. The engine's own default is 0, since an engine started by hand has no
gateway to warm it."""

MAX_WARM_START_SECONDS = engine_flag("kv_warm_start_seconds").maximum or 0.0
"""The flag's own bound (`engine_flags`), which the spec field takes."""

MAX_HOT_CHAINS = 256
"""Chains one hot list names at most (each root → leaf, hottest first)."""
DEFAULT_WARM_BLOCKS = 4096
DEFAULT_WARM_DEADLINE_S = 10.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KVHotRequest(_Strict):
    """`hot`: at most `max_blocks` distinct blocks, in at most `max_chains` chains."""

    max_blocks: int = Field(default=DEFAULT_WARM_BLOCKS, ge=1, le=MAX_TRANSFER_BLOCKS)
    max_chains: int = Field(default=MAX_HOT_CHAINS, ge=1, le=MAX_HOT_CHAINS)


class KVHotChain(_Strict):
    """One cached chain, parent → child, from the model's root (no adapter)."""

    hashes: list[HexHash] = Field(min_length=1, max_length=MAX_TRANSFER_BLOCKS)


class KVHotList(_Strict):
    chains: list[KVHotChain] = Field(max_length=MAX_HOT_CHAINS)


class KVWarmRequest(_Strict):
    """`warm`: pull the sources' hot chains, then become ready. No sources: ready now."""

    sources: list[str] = Field(default_factory=list, max_length=MAX_SOURCES)
    max_blocks: int = Field(default=DEFAULT_WARM_BLOCKS, ge=0, le=MAX_TRANSFER_BLOCKS)
    deadline_s: float = Field(default=DEFAULT_WARM_DEADLINE_S, gt=0.0, le=MAX_DEADLINE_S)


class KVWarmResult(_Strict):
    blocks: int  # blocks pulled into this cache
    chains: int  # chains (or their missing tails) asked for
    seconds: float
    sources: dict[str, int]  # blocks pulled from each source


class KVWarmStartSpec(ApiModel):
    """`spec.kvWarmStart`: how long a new replica waits to be warmed, and how much
    the gateway has it pull (servefleet engines with the prefix cache on)."""

    seconds: float = Field(
        default=WARM_START_SECONDS,
        ge=0.0,
        le=MAX_WARM_START_SECONDS,
        description="Longest a new replica's /ready says kv-warming while it waits for the "
        "gateway's warm call (--kv-warm-start-seconds): a cold start grows by at most this. "
        "0: ready at once, never warmed.",
    )
    max_blocks: int = Field(
        default=DEFAULT_WARM_BLOCKS,
        ge=0,
        le=MAX_TRANSFER_BLOCKS,
        description="Most KV blocks one warm start pulls from the peers' hot lists (the "
        "engine takes at most half its own pool whatever this says).",
    )
    deadline_seconds: float = Field(
        default=DEFAULT_WARM_DEADLINE_S,
        gt=0.0,
        le=MAX_DEADLINE_S,
        description="Longest one warm start pulls before the replica reports ready.",
    )
