"""Engine ↔ engine KV transfer over HTTP: info, lookup, export and import of cached blocks.

Plain HTTP/1.1 with raw streamed bodies on the engine's own port: the key middleware, the
NetworkPolicy and local mode work unchanged, and on a CPU the wire is not what limits a
transfer (see the engine README). Every path needs the engine key (none is in
`api_key.OPEN_PATHS`): only the gateway and the deployment's own engines hold it. Hash lists
travel in POST bodies under their own cap (`MAX_LOOKUP_BODY_BYTES`), never in query strings.
A puller whose fingerprint differs gets 409 `kv_fingerprint_mismatch`: blocks are never
converted or used across models, numerics or layouts.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from servefleet.api.kv_blocks import root_hash
from servefleet.api.kv_transfer import (
    EXPORT_PATH,
    FINGERPRINT_HEADER,
    FINGERPRINT_MISMATCH,
    IMPORT_PATH,
    INFO_PATH,
    LOOKUP_PATH,
    MAX_LOOKUP_BODY_BYTES,
    MAX_PREFILL_BODY_BYTES,
    MAX_TRANSFER_BLOCKS,
    MEDIA_TYPE,
    WINDOW_BLOCKS,
    KVHashesRequest,
    KVPrefillRequest,
    Outcome,
)
from servefleet.api.openai_errors import OpenAIError
from servefleet.api.openai_wire import parse_object, validate
from servefleet.engine.kv_prefill import check_prefill, prefill_export_stream
from servefleet.engine.kv_store import KVStore, VerifiedBlock
from servefleet.engine.kv_transfer import export_stream, import_blocks
from servefleet.engine.kv_wire import WireError, WireReader
from servefleet.engine.request_checks import parse, read_body

if TYPE_CHECKING:
    from servefleet.engine.serving_state import ServingState


def fingerprint_mismatch() -> OpenAIError:
    return OpenAIError(
        status=409,
        message="KV blocks of another model, numerics or cache layout: not used",
        type="conflict",
        code=FINGERPRINT_MISMATCH,
    )


def _store(state: ServingState) -> KVStore:
    if state.kv_store is None:
        raise OpenAIError(status=400, message="this engine does not transfer KV blocks")
    return state.kv_store


def _check_fingerprint(request: Request, store: KVStore) -> None:
    sent = request.headers.get(FINGERPRINT_HEADER)
    if sent is not None and sent != store.fingerprint:
        raise fingerprint_mismatch()


def add_kv_routes(app: FastAPI, state: ServingState) -> None:
    @app.get(INFO_PATH)
    async def info() -> dict[str, Any]:
        store = _store(state)
        return {
            "fingerprint": store.fingerprint,
            "fields": store.fields,
            "bytes_per_block": store.bytes_per_block,
            "num_blocks": store.kv.num_blocks,
            "transfer_cap_blocks": store.cap,
            "pinned_blocks": store.pinned,
            "staged_blocks": store.staged,
            "media_type": MEDIA_TYPE,
        }

    @app.post(LOOKUP_PATH)
    async def lookup(request: Request) -> dict[str, int]:
        store = _store(state)
        _check_fingerprint(request, store)
        body = await parse(request, KVHashesRequest, MAX_LOOKUP_BODY_BYTES)
        hashes = [int(h, 16) for h in body.hashes]
        return {"cached": await state.engine.call(lambda: store.held_run(hashes))}

    @app.post(EXPORT_PATH, response_model=None)
    async def export(request: Request) -> StreamingResponse:
        store = _store(state)
        _check_fingerprint(request, store)
        raw = await read_body(request, MAX_PREFILL_BODY_BYTES)
        data = parse_object(raw)
        if "compute" in data:  # prefill and export (P/D): `kv_prefill`
            prefill = validate(KVPrefillRequest, data)
            adapter = check_prefill(state, store, prefill)
            asked = len(prefill.prompt_token_ids) // store.block_size - prefill.start_block
            stream = prefill_export_stream(state.engine, store, prefill, adapter)
            return StreamingResponse(_counted(state, stream, asked), media_type=MEDIA_TYPE)
        if len(raw) > MAX_LOOKUP_BODY_BYTES:
            raise OpenAIError(status=413, message="an export body names too many hashes")
        body = validate(KVHashesRequest, data)
        hashes = [int(h, 16) for h in body.hashes]
        stream = export_stream(state.engine, store, hashes, body.adapter_identity)
        return StreamingResponse(_counted(state, stream, len(hashes)), media_type=MEDIA_TYPE)

    @app.post(IMPORT_PATH)
    async def import_(request: Request) -> dict[str, Any]:
        store = _store(state)
        _check_fingerprint(request, store)
        return await _import(state, store, request)


async def _counted(
    state: ServingState, stream: AsyncIterator[bytes], asked: int
) -> AsyncIterator[bytes]:
    """The export stream (one chunk per block frame), counted once it ends."""
    started, nbytes, blocks = time.monotonic(), 0, 0
    bpb = state.kv_store.bytes_per_block if state.kv_store else 1
    complete = False
    try:
        async for chunk in stream:
            nbytes += len(chunk)
            blocks += len(chunk) >= bpb
            yield chunk
        complete = True
    finally:
        outcome: Outcome = "ok" if complete and blocks == asked else "partial"
        if not complete and not blocks:
            outcome = "failed"
        seconds = time.monotonic() - started
        state.engine.metrics.kv_transfer.transfer("export", outcome, blocks, nbytes, seconds)


async def _import(state: ServingState, store: KVStore, request: Request) -> dict[str, Any]:
    """A pushed stream: blocks are published window by window as they verify; an error
    keeps what verified before it (whole blocks) and answers why."""
    started = time.monotonic()
    reader = WireReader(store.fingerprint, store.block_size, store.bytes_per_block, None)
    pending: list[VerifiedBlock] = []
    committed, error, rooted, first = 0, None, False, None
    try:
        async for chunk in request.stream():
            try:
                pending += reader.feed(chunk)
            except WireError as exc:
                pending += exc.blocks
                raise
            if reader.count > MAX_TRANSFER_BLOCKS:
                raise WireError("too_many_blocks", f"more than {MAX_TRANSFER_BLOCKS} blocks")
            if not rooted and pending:
                first = await _check_first_parent(state, store, reader, pending[0])
                rooted = True
            if len(pending) >= WINDOW_BLOCKS:
                committed += await import_blocks(state.engine, store, pending, first)
                pending = []
    except WireError as exc:
        error = exc
    except ClientDisconnect:
        error = WireError("client_closed", "the stream ended early")
    if pending and not rooted:  # the stream broke in its first chunk: check the root now
        try:
            first = await _check_first_parent(state, store, reader, pending[0])
        except WireError:
            pending = []
    if pending and (error is None or error.code != FINGERPRINT_MISMATCH):
        committed += await import_blocks(state.engine, store, pending, first)
    nbytes = reader.count * store.bytes_per_block
    outcome: Outcome = "partial" if committed else "refused"
    if error is None and reader.complete:
        outcome = "ok"
    seconds = time.monotonic() - started
    state.engine.metrics.kv_transfer.transfer("import", outcome, committed, nbytes, seconds)
    if error is not None and error.code == FINGERPRINT_MISMATCH:
        raise fingerprint_mismatch()
    if error is not None:
        raise OpenAIError(status=400, message=f"{error} ({committed} blocks kept)", code=error.code)
    return {"committed": committed, "received": reader.count, "complete": reader.complete}


async def _check_first_parent(
    state: ServingState, store: KVStore, reader: WireReader, first: VerifiedBlock
) -> int | None:
    """A pushed chain starts at its adapter's root or at a block this cache holds; the first
    block's hash when it starts the base model's chain (marked `first`, `KVStore.commit`)."""
    assert reader.header is not None
    adapter = reader.header.get("adapter_identity")
    if first.parent_hash == root_hash(adapter):
        return first.block_hash if adapter is None else None
    held = await state.engine.call(lambda: store.held_run([first.parent_hash]))
    if not held:
        raise WireError("chain_mismatch", "the first block's parent is not cached here")
    return None
