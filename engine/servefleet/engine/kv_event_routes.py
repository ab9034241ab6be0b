"""`GET /internal/kv/events`: the prefix cache's changes as Server-Sent Events.

Behind the engine key like every `/internal/kv/*` route (only the gateway and the
deployment's own engines hold it): the stream names which prompts' prefixes this replica
holds. At most `MAX_SUBSCRIBERS` streams at once (a 503 past that); each reads the engine's
bounded ring from its own position, so a slow reader costs nothing but a snapshot later.
The resident LoRA adapters' identities go with the hello, each snapshot, and the first batch
after they changed (a load or eviction logs an empty batch to wake the streams): they are
the roots of adapter chains, which the gateway needs to hash an adapter's prompt.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from servefleet.api.kv_events import (
    BATCH_EVENT,
    EVENTS_PATH,
    HELLO_EVENT,
    KEEPALIVE_S,
    MEDIA_TYPE,
    SNAPSHOT_EVENT,
    event_id,
    parse_event_id,
)
from servefleet.api.kv_transfer import hash_hex
from servefleet.api.openai_errors import OpenAIError
from servefleet.engine.kv_events import LoggedBatch, Subscription, TooManySubscribers

if TYPE_CHECKING:
    from servefleet.engine.serving_state import ServingState


def sse(event: str, data: dict[str, Any], ident: str | None = None) -> bytes:
    head = f"id: {ident}\n" if ident is not None else ""
    body = json.dumps(data, separators=(",", ":"))
    return f"{head}event: {event}\ndata: {body}\n\n".encode()


def hello(state: ServingState) -> dict[str, Any]:
    engine, store = state.engine, state.kv_store
    bytes_per_token = store.bytes_per_block // store.block_size if store is not None else 0
    return {
        "epoch": engine.kv_events.epoch,
        "block_size": state.block_size,
        "num_blocks": state.num_kv_blocks,
        "fingerprint": store.fingerprint if store is not None else None,
        **_rates(state),
        "bytes_per_token": bytes_per_token,
        "adapters": adapters(state),
    }


def adapters(state: ServingState) -> dict[str, int]:
    """Resident adapter name -> identity (none without --enable-lora)."""
    return state.loras.identities() if state.loras is not None else {}


def _rates(state: ServingState) -> dict[str, float]:
    store = state.kv_store
    return {
        "prompt_tokens_per_second": state.engine.prompt_rate.value,
        "pull_bytes_per_second": store.pull_rate.value if store is not None else 0.0,
        "step_seconds": state.engine.step_time.value,
    }


def batch_data(state: ServingState, batch: LoggedBatch) -> dict[str, Any]:
    data: dict[str, Any] = {
        "seq": batch.seq,
        "ts": batch.ts,
        "stored": [[hash_hex(h), hash_hex(p)] for h, p in batch.stored],
        "removed": [hash_hex(h) for h in batch.removed],
        **_rates(state),
    }
    if batch.cleared:
        data["cleared"] = True
    return data


def add_kv_event_routes(app: FastAPI, state: ServingState) -> None:
    @app.get(EVENTS_PATH, response_model=None)
    async def events(request: Request) -> StreamingResponse:
        log = state.engine.kv_events
        try:
            sub = log.subscribe()
        except TooManySubscribers as exc:
            raise OpenAIError(status=503, message=str(exc), type="server_overloaded") from None
        last = parse_event_id(request.headers.get("last-event-id"))
        seq = last[1] if last is not None and last[0] == log.epoch else None
        return StreamingResponse(
            _stream(state, sub, seq),
            media_type=MEDIA_TYPE,
            # Also when the client left before the stream started (its finally never runs).
            background=BackgroundTask(log.unsubscribe, sub),
        )


async def _snapshot(state: ServingState) -> tuple[int, bytes]:
    seq, cached = await state.engine.call(state.engine.kv_snapshot)
    data = {
        "seq": seq,
        "stored": [[hash_hex(h), hash_hex(p)] for h, p in cached],
        "adapters": adapters(state),
    }
    return seq, sse(SNAPSHOT_EVENT, data, event_id(state.engine.kv_events.epoch, seq))


async def _stream(state: ServingState, sub: Subscription, seq: int | None) -> AsyncIterator[bytes]:
    log = state.engine.kv_events
    try:
        first = hello(state)
        sent = first["adapters"]  # the adapters this stream last told of
        yield sse(HELLO_EVENT, first)
        if seq is None or log.since(seq) is None:
            seq, snap = await _snapshot(state)
            yield snap
        idle_since = time.monotonic()
        while not state.draining:
            sub.wake.clear()
            batches = log.since(seq)
            if batches is None:  # fell behind the ring
                seq, snap = await _snapshot(state)
                yield snap
                continue
            for batch in batches:
                seq, data, now = batch.seq, batch_data(state, batch), adapters(state)
                if now != sent:
                    data["adapters"] = sent = now
                yield sse(BATCH_EVENT, data, event_id(log.epoch, seq))
            if batches:
                idle_since = time.monotonic()
            try:
                await asyncio.wait_for(sub.wake.wait(), timeout=KEEPALIVE_S)
            except TimeoutError:
                if time.monotonic() - idle_since >= KEEPALIVE_S:
                    yield b": keepalive\n\n"
                    idle_since = time.monotonic()
    finally:
        log.unsubscribe(sub)
