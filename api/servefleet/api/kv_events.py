"""KV cache events: which blocks an engine's prefix cache holds, as it changes.

The engine publishes, per step, the blocks it stored (by hash, with their parent) and evicted,
and whether it cleared its cache, on `EVENTS_PATH` as Server-Sent Events (vLLM's
`BlockStored` / `BlockRemoved` / `AllBlocksCleared`, over SSE on the engine's own port and
key instead of ZMQ). A block is announced only after the step that wrote its KV ran, so no
listener hears of a block before it can be exported. The gateway's index (`KVIndex`) follows
these streams to route by the real cache contents. Standard library and pydantic only.

Stream: `hello` first, then `snapshot` (every cached hash) unless the `Last-Event-ID` sent is
still in the engine's ring, then one `batch` per step that changed something. Event ids are
`<epoch>-<seq>`: the epoch changes when the engine process restarts, so an old id is never
mistaken for a new one.

Adapters: `hello`, `snapshot` and any `batch` after a change carry `adapters`, the engine's
resident LoRA adapters as name -> identity (`LoraAdapter.identity`, the signed 64-bit digest
of its weight files that roots its KV chain), so the gateway hashes an adapter's prompt as
the engine does. Absent (an older engine, or nothing changed since the last one sent): the
subscriber keeps what it knew (nothing: adapter prompts are not hashed).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from servefleet.api.kv_transfer import HexHash

EVENTS_PATH = "/internal/kv/events"
MEDIA_TYPE = "text/event-stream"
HELLO_EVENT = "hello"
SNAPSHOT_EVENT = "snapshot"
BATCH_EVENT = "batch"

RING_STEPS = 1024
"""Per-step batches an engine keeps for resuming subscribers; older ids get a snapshot."""
MAX_SUBSCRIBERS = 8
"""Event streams one engine serves at once (a 503 past it): one per gateway replica."""
KEEPALIVE_S = 5.0
"""A comment line this often on an idle stream, so a dead peer is noticed."""
MAX_EVENT_BYTES = 16 * 1024 * 1024
"""Longest event a subscriber reads (a snapshot of a big cache: ~75 bytes per block)."""

# ---- gateway metrics
ROUTE_DECISIONS_METRIC = "servefleet_gateway_kv_route_decisions_total"
"""Requests routed by cache contents, by `decision`: `go_to_holder` (the replica holding the
longest prefix), `pull` (another replica, which pulls the prefix from the holder),
`recompute` (another replica, which recomputes it), `local` (the prompt was hashed but no
replica is known to hold its first block: the prompt-affinity rule decides), `pd` (a
disaggregated deployment's prefill replica computes the prompt for the decode replica)."""
DECISION_LABEL = "decision"
DECISIONS = ("local", "pull", "go_to_holder", "recompute", "pd")
INDEX_BLOCKS_METRIC = "servefleet_gateway_kv_index_blocks"
"""(block, replica) pairs the gateway's index holds per deployment."""
EVENTS_LAG_METRIC = "servefleet_gateway_kv_events_lag_seconds"
"""Per deployment, the largest over its replicas of how late the newest applied batch was:
the gateway's clock when it applied it minus the engine's `ts` (clocks of one node agree; across
nodes NTP's skew adds in). A lag that grows means routing follows a stale picture."""

AdapterIdentity = Annotated[int, Field(ge=-(2**63), lt=2**63)]
AdapterIdentities = dict[str, AdapterIdentity]
"""Resident adapter name -> identity, as the engine loaded it."""


def event_id(epoch: str, seq: int) -> str:
    return f"{epoch}-{seq}"


def parse_event_id(value: str | None) -> tuple[str, int] | None:
    """(epoch, seq) of a `Last-Event-ID`; None when absent or malformed (a snapshot follows)."""
    if not value or "-" not in value:
        return None
    epoch, _, seq = value.rpartition("-")
    return (epoch, int(seq)) if seq.isdigit() and epoch else None


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # newer engines may say more


class KVHello(_Message):
    """What a subscriber needs to size and cost a replica's cache."""

    epoch: str
    block_size: int = Field(ge=1)
    num_blocks: int = Field(ge=1)
    fingerprint: str | None = None  # KV transfer's; None when the engine transfers no KV
    bytes_per_token: int = Field(default=0, ge=0)
    prompt_tokens_per_second: float = Field(default=0.0, ge=0)  # measured; 0 = not yet
    pull_bytes_per_second: float = Field(default=0.0, ge=0)  # measured; 0 = no pull yet
    step_seconds: float = Field(default=0.0, ge=0)  # a step's time (EWMA): an export's wait
    adapters: AdapterIdentities | None = None  # None: an engine that does not say


class KVSnapshot(_Message):
    """Every hash the cache holds as of `seq` (later batches follow it)."""

    seq: int = Field(ge=0)
    stored: list[tuple[HexHash, HexHash]]  # [hash, parent]
    adapters: AdapterIdentities | None = None


class KVEventBatch(_Message):
    """One step's changes. Apply `cleared`, then `removed`, then `stored`."""

    seq: int = Field(ge=1)
    ts: float
    stored: list[tuple[HexHash, HexHash]] = Field(default_factory=list)  # [hash, parent]
    removed: list[HexHash] = Field(default_factory=list)
    cleared: bool = False
    prompt_tokens_per_second: float = Field(default=0.0, ge=0)
    pull_bytes_per_second: float = Field(default=0.0, ge=0)
    step_seconds: float = Field(default=0.0, ge=0)
    adapters: AdapterIdentities | None = None  # only when they changed since the last sent
