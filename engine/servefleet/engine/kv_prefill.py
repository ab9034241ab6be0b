"""Prefill and export (disaggregated P/D, the prefill side): compute a prompt's KV for a
decode engine and stream its blocks while later chunks are still being computed.

The prompt runs as a `prefill_only` sequence: the scheduler chunks it under this engine's
own `max_num_batched_tokens` like any prompt, it never samples, and it finishes once every
token's KV is written. The stream follows it step by step: each round is one
`Engine.call`, which runs between two steps, so every block the finished steps wrote is
complete; those blocks are pinned, copied off the engine thread and sent in the wire format
of a plain export (`kv_transfer`), while the next step computes the next chunk. Blocks
already cached go out at once. A sequence whose caller leaves is aborted; a block evicted
before it was pinned ends the stream early, and the decode engine recomputes the rest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, Any

from servefleet.api.kv_blocks import chain, root_hash
from servefleet.api.kv_transfer import (
    MAX_PREFILL_EXPORTS,
    PREFILL_BUSY,
    WINDOW_BLOCKS,
    KVPrefillRequest,
)
from servefleet.api.openai_errors import OpenAIError
from servefleet.engine.kv_store import KVStore
from servefleet.engine.kv_transfer import call_or_undo, header_fields
from servefleet.engine.kv_wire import END, encode_frame, encode_header
from servefleet.engine.loop import Engine
from servefleet.engine.protocol import new_id
from servefleet.engine.request_checks import admit, prompt_ids
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.sequence import Sequence

if TYPE_CHECKING:
    from servefleet.engine.lora.adapter import LoraAdapter
    from servefleet.engine.serving_state import ServingState

IDLE_POLL_S = 0.002
"""Wait before asking again when no new block was ready (a round already waits one step
when the engine is busy; this only keeps an idle round from spinning)."""
_background: set[asyncio.Future[Any]] = set()
_queued: set[int] = set()  # seq ids of prefill-only sequences in a scheduler (engine thread)


def check_prefill(
    state: ServingState, store: KVStore, body: KVPrefillRequest
) -> LoraAdapter | None:
    """Refuse at once (before any byte streams), naming the field: not ready, an unknown
    adapter, ids outside the vocabulary, a prompt under one block or over the context, or
    every prefill slot taken. Returns the adapter to compute under."""
    adapter = admit(state, body.adapter or state.served_model_name)
    prompt_ids(state, body.prompt_token_ids, "prompt_token_ids")
    if len(body.prompt_token_ids) < store.block_size:
        raise OpenAIError(
            status=400,
            message=f"prompt_token_ids: fewer than one block ({store.block_size} tokens)",
            param="prompt_token_ids",
        )
    if len(body.prompt_token_ids) > state.max_model_len:
        raise OpenAIError(
            status=400,
            message=f"prompt_token_ids: longer than the context ({state.max_model_len})",
            param="prompt_token_ids",
            code="context_length_exceeded",
        )
    if store.prefilling >= MAX_PREFILL_EXPORTS:
        raise OpenAIError(
            status=429,
            message=f"this engine already prefills {MAX_PREFILL_EXPORTS} prompts for export",
            type="rate_limit_exceeded",
            code=PREFILL_BUSY,
            headers={"Retry-After": "1"},
        )
    return adapter


async def prefill_export_stream(
    engine: Engine, store: KVStore, body: KVPrefillRequest, adapter: LoraAdapter | None
) -> AsyncIterator[bytes]:
    """The full blocks of `body.prompt_token_ids` from `start_block`, each as soon as it is
    computed (or at once when cached), on the export wire."""
    bs = store.block_size
    tokens = body.prompt_token_ids[: len(body.prompt_token_ids) // bs * bs]
    identity = adapter.identity if adapter is not None else None
    hashes = chain(root_hash(identity, body.cache_salt), tokens, bs)
    start = min(body.start_block, len(hashes))
    seq = Sequence(
        prompt_token_ids=tokens,
        params=SamplingParams(max_tokens=1),
        arrival_time=time.monotonic(),
        request_id=new_id("prefill"),
        lora=adapter,
        prefill_only=True,
        cache_salt=body.cache_salt,
    )
    store.prefilling += 1
    try:
        yield encode_header(header_fields(store, identity, len(hashes) - start))
        held = await engine.call(partial(_start, engine, store, seq, hashes))
        done = start
        while done < len(hashes):
            ready, over = await engine.call(partial(_computed_blocks, seq, bs, held, len(hashes)))
            if ready <= done:
                if over:
                    break  # aborted (the engine is stopping): the caller recomputes the rest
                await asyncio.sleep(IDLE_POLL_S)
                continue
            window = hashes[done : min(ready, done + min(WINDOW_BLOCKS, store.cap))]
            frames = await _pinned_frames(engine, store, window, identity)
            for frame in frames:
                yield frame
            done += len(frames)
            if len(frames) < len(window):
                break  # evicted before it was pinned: the caller recomputes the rest
        yield END
    finally:
        store.prefilling -= 1
        stop = asyncio.ensure_future(engine.call(partial(_stop, engine, seq)))
        _background.add(stop)  # runs even when this stream was cancelled
        stop.add_done_callback(_background.discard)


async def _pinned_frames(
    engine: Engine, store: KVStore, window: list[int], identity: int | None
) -> list[bytes]:
    """Pin the cached run of `window`, copy it off the engine thread, unpin: its frames."""
    held, _ = await call_or_undo(
        engine, partial(store.pin, window), lambda result: store.unpin(result[0])
    )
    if not held:
        return []
    try:
        data = await asyncio.to_thread(store.read, [b.block_id for b in held])
    finally:
        await engine.call(partial(store.unpin, held))
    return [
        encode_frame(b.block_hash, b.parent_hash, b.token_ids, identity, payload)
        for b, payload in zip(held, data, strict=True)
    ]


# ---- engine thread (via Engine.call) ------------------------------------------------------
def _start(engine: Engine, store: KVStore, seq: Sequence, hashes: list[int]) -> int:
    """Queue the prefill-only sequence unless every block is cached; the cached run's
    length (those blocks go out before any step)."""
    held = store.held_run(hashes)
    if held < len(hashes):
        engine.scheduler.add(seq)
        engine.adapter_usage.add(seq.lora)
        _queued.add(seq.seq_id)
    return held


def _computed_blocks(seq: Sequence, block_size: int, held: int, total: int) -> tuple[int, bool]:
    """(leading blocks whose KV is written now, whether the sequence is over)."""
    if seq.seq_id not in _queued:
        return held, True  # everything was cached
    if seq.is_finished and seq.num_computed_tokens >= seq.num_tokens:
        return total, True
    return max(held, seq.num_computed_tokens // block_size), seq.is_finished


def _stop(engine: Engine, seq: Sequence) -> None:
    """Abort the sequence if it still runs (its caller left) and release its adapter."""
    if seq.seq_id not in _queued:
        return
    _queued.discard(seq.seq_id)
    if not seq.is_finished:
        engine.scheduler.abort(seq)
    engine.adapter_usage.remove(seq.lora)
