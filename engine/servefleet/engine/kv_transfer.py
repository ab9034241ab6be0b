"""Moving blocks: an export stream out of a cache, verified blocks into one.

Both go in windows of `WINDOW_BLOCKS`: each window is one `Engine.call` to pin (or stage),
a copy off the engine thread, and one call to unpin (or commit), so a transfer never holds
more than its share of the pool and never stalls the engine for more than a pool walk.
Imported blocks are published in chain order, window by window, only once every byte of
each one arrived and verified (`kv_wire`); anything staged and not verified is freed
without a hash, never visible.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any, TypeVar

from servefleet.api.kv_transfer import WINDOW_BLOCKS
from servefleet.engine.kv_store import HeldBlock, KVStore, VerifiedBlock
from servefleet.engine.kv_wire import END, encode_frame, encode_header
from servefleet.engine.loop import Engine

T = TypeVar("T")
_background: set[asyncio.Future[Any]] = set()  # undo calls still queued (kept referenced)


async def call_or_undo(engine: Engine, fn: Callable[[], T], undo: Callable[[T], Any]) -> T:
    """`engine.call(fn)`; if the caller is cancelled meanwhile, fn still runs on the engine
    thread, so its result (pinned or staged blocks) is handed to `undo` there instead of
    leaking."""
    task: asyncio.Future[T] = asyncio.ensure_future(engine.call(fn))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:

        def later(done: asyncio.Future[T]) -> None:
            if not done.cancelled() and done.exception() is None:
                undone = asyncio.ensure_future(engine.call(partial(undo, done.result())))
                _background.add(undone)
                undone.add_done_callback(_background.discard)

        task.add_done_callback(later)
        raise


def _unpin_result(store: KVStore) -> Callable[[tuple[list[HeldBlock], bool]], None]:
    return lambda result: store.unpin(result[0])


def header_fields(store: KVStore, adapter_identity: int | None, count: int) -> dict[str, Any]:
    f = store.fields
    return {
        "fingerprint": store.fingerprint,
        "kv_dtype": f["kv_cache_dtype"],
        "block_size": f["block_size"],
        "layers": f["num_layers"],
        "kv_heads": f["num_kv_heads"],
        "row_width": f["row_width"],
        "bytes_per_block": store.bytes_per_block,
        "adapter_identity": adapter_identity,
        "count": count,
    }


async def export_stream(
    engine: Engine, store: KVStore, hashes: list[int], adapter_identity: int | None
) -> AsyncIterator[bytes]:
    """The held leading run of `hashes` on the wire; ends early where the run ends (a block
    evicted between windows, or the export cap reached)."""
    yield encode_header(header_fields(store, adapter_identity, len(hashes)))
    done = 0
    while done < len(hashes):
        window = hashes[done : done + min(WINDOW_BLOCKS, store.cap)]
        held, ended = await call_or_undo(engine, partial(store.pin, window), _unpin_result(store))
        try:
            if not held:
                break
            data = await asyncio.to_thread(store.read, [b.block_id for b in held])
        finally:
            if held:
                await engine.call(partial(store.unpin, held))
        for block, payload in zip(held, data, strict=True):
            yield encode_frame(
                block.block_hash, block.parent_hash, block.token_ids, adapter_identity, payload
            )
        done += len(held)
        if ended:
            break
    yield END


async def import_blocks(
    engine: Engine, store: KVStore, blocks: list[VerifiedBlock], first: int | None = None
) -> int:
    """Stage, write and publish `blocks` (in chain order); how many are now cached (stops at
    the first window that cannot be staged: the rest is recomputed by whoever needs it).
    `first`: the hash of a chain's first block, if the importer knows it (`KVStore.commit`)."""
    committed = 0
    while committed < len(blocks):
        window = blocks[committed : committed + WINDOW_BLOCKS]
        ids = await call_or_undo(
            engine, partial(store.stage, len(window)), partial(_discard, store)
        )
        if not ids:
            break
        try:
            await asyncio.to_thread(store.write, ids, [b.data for b in window[: len(ids)]])
        except BaseException:
            await engine.call(partial(_discard, store, ids))
            raise
        await engine.call(partial(store.commit, ids, window[: len(ids)], first))
        committed += len(ids)
    return committed


def _discard(store: KVStore, ids: list[int]) -> int:
    return store.commit(ids, [])
