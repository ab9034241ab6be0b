"""`kv_transfer_params`: pull a request's missing leading KV blocks from peers, then run it.

The gateway (only it: `stream_resume.INTERNAL_FIELDS` refuses the field from tenants, and
the engine honours it only behind its key) names engines that likely hold the prompt's
prefix. Before the request is queued this engine hashes the prompt's full blocks exactly as
its prefix cache does, looks its own cache up, and streams the missing run from each source
in turn (`kv_routes` export), publishing verified blocks window by window; the scheduler then
finds them as an ordinary prefix hit and computes only the rest. Nothing here blocks the
engine thread: pool work goes through `Engine.call`, bytes move on the asyncio loop and a
worker thread. On any error, or past `deadline_s`, the verified prefix stays and the rest is
recomputed, so a pull costs at most its deadline. Sources are contacted only inside
`--kv-peer-networks`, because the engine sends its own key there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx

from servefleet.api.ewma import Ewma
from servefleet.api.kv_blocks import chain, root_hash
from servefleet.api.kv_transfer import (
    EXPORT_PATH,
    FINGERPRINT_HEADER,
    LOOKUP_PATH,
    MAX_TRANSFER_BLOCKS,
    WINDOW_BLOCKS,
    KVTransferParams,
    Outcome,
    hash_hex,
)
from servefleet.api.openai_errors import OpenAIError
from servefleet.api.replica_endpoints import ReplicaTargets
from servefleet.api.stream_resume import KV_TRANSFER_PARAMS
from servefleet.engine.kv_store import KVStore, VerifiedBlock
from servefleet.engine.kv_transfer import import_blocks
from servefleet.engine.kv_wire import WireError, WireReader
from servefleet.engine.loop import EngineRequest

if TYPE_CHECKING:
    from servefleet.engine.serving_state import ServingState

log = logging.getLogger("servefleet.engine.kv")
_PARAM = KV_TRANSFER_PARAMS + ".kv_sources"
_REMOTE = KV_TRANSFER_PARAMS + ".remote_prefill"


def check_kv_transfer(state: ServingState, params: KVTransferParams | None) -> None:
    """Refuse, naming the field, what this engine cannot honour: no prefix cache, or a
    source outside --kv-peer-networks (or not an http URL with an IP literal host)."""
    if params is None:
        return
    if state.kv_store is None or not state.kv_store.kv.enable_caching:
        raise OpenAIError(
            status=400,
            message=f"{KV_TRANSFER_PARAMS} needs the prefix cache (drop --no-prefix-caching)",
            param=KV_TRANSFER_PARAMS,
        )
    # a source is checked as a replica endpoint is (an address, never a name: it resolves
    # where nobody checked it), inside this engine's peer networks
    peers = ReplicaTargets(state.kv_peer_networks, frozenset(), "this engine's --kv-peer-networks")
    for source in params.kv_sources:
        if (problem := peers.problem(source)) is not None:
            raise OpenAIError(status=400, message=f"{_PARAM}: {source!r} {problem}", param=_PARAM)
    remote = params.remote_prefill
    if remote is not None and (problem := peers.problem(remote)) is not None:
        raise OpenAIError(status=400, message=f"{_REMOTE}: {remote!r} {problem}", param=_REMOTE)


async def pull_prefix(
    state: ServingState, params: KVTransferParams | None, request: EngineRequest
) -> int:
    """Blocks pulled into this cache for `request`'s prompt (0 when nothing was missing).

    Pulls of prompts that start alike are made one at a time: the first registers, before
    anything awaits, under its first block; one that finds it registered waits for it (to its
    own deadline), then pulls only what is still missing, so the same bytes move once."""
    store = state.kv_store
    if params is None or store is None:
        return 0
    tokens = [*request.prompt_token_ids, *request.resume_token_ids]
    usable = (len(tokens) - 1) // store.block_size  # the scheduler always computes one token
    adapter = request.lora.identity if request.lora is not None else None
    root = root_hash(adapter, request.cache_salt)
    hashes = chain(root, tokens[: usable * store.block_size], store.block_size)
    hashes = hashes[:MAX_TRANSFER_BLOCKS]
    if params.remote_prefill is not None:
        held = await state.engine.call(partial(store.held_run, hashes))
        return await remote_prefill(state, params, request, tokens, held, len(hashes))
    if not hashes:
        return 0
    deadline = time.monotonic() + params.deadline_s
    mine, under_way = None, store.pulling.get(hashes[0])
    if under_way is None:
        mine = store.pulling[hashes[0]] = asyncio.Event()
    try:
        if under_way is not None:
            state.engine.metrics.kv_transfer.join()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(under_way.wait(), max(0.0, deadline - time.monotonic()))
        held = await state.engine.call(partial(store.held_run, hashes))
        missing = hashes[held:]
        if missing and not worth_pulling(state.engine.prompt_rate, store, len(missing)):
            state.engine.metrics.kv_transfer.fallback("recompute_cheaper")
            return 0
        first = chain_start(hashes, adapter)
        return await _pull_missing(state, store, params, missing, adapter, deadline, first)
    finally:
        if mine is not None:
            mine.set()
            del store.pulling[hashes[0]]


async def _pull_missing(
    state: ServingState,
    store: KVStore,
    params: KVTransferParams,
    missing: list[int],
    adapter: int | None,
    deadline: float,
    first: int | None,
) -> int:
    """`missing` from the sources (the likeliest holder first) until the deadline; `first`
    as `pull_from` takes it."""
    if not missing:
        return 0
    pulled = 0
    sources = [s.rstrip("/") for s in params.kv_sources]
    if len(sources) > 1:
        sources = await rank_sources(state, store, sources, missing, deadline)
    for source in sources:
        if not missing or time.monotonic() >= deadline:
            break
        got = await pull_from(state, store, source, missing, adapter, deadline, first=first)
        pulled += got
        missing = missing[got:]
    if missing:
        state.engine.metrics.kv_transfer.fallback("incomplete" if pulled else "nothing_pulled")
    return pulled


def chain_start(hashes: list[int], adapter: int | None) -> int | None:
    """A request's first block, when its chain is the base model's (salted or not): computed
    here from the request's own root, so an import may mark it `first` (`KVStore.commit`)
    as the scheduler marks a computed one. Adapter chains never are (`kv_warm` skips them)."""
    return hashes[0] if hashes and adapter is None else None


def worth_pulling(prompt_rate: Ewma, store: KVStore, blocks: int) -> bool:
    """Whether moving `blocks` is expected to take less than recomputing them, from this
    engine's own measurements: its prompt steps' token rate and past pulls' bandwidth. On a
    CPU a pull wins by far (SmolLM2: ~5 ms a block over loopback vs ~30 ms to recompute);
    on a GPU that prefills tens of thousands of tokens a second the HTTP data plane loses
    for a small model, so the engine recomputes. Unmeasured (no pull or prompt step yet):
    pull, and so learn."""
    if prompt_rate.samples == 0 or store.pull_rate.samples == 0:
        return True
    pull_s = blocks * store.bytes_per_block / store.pull_rate.value
    return pull_s < blocks * store.block_size / prompt_rate.value


async def rank_sources(
    state: ServingState, store: KVStore, sources: list[str], hashes: list[int], deadline: float
) -> list[str]:
    """The sources that hold some of `hashes`' leading run, longest holder first (a tie
    keeps the caller's order): each is asked `lookup` at once, so a dead or empty source
    (a failover's guesses) costs one round trip, in parallel, not a failed export."""
    timeout = max(0.001, deadline - time.monotonic())
    headers = {FINGERPRINT_HEADER: store.fingerprint}
    if state.api_key:
        headers["Authorization"] = f"Bearer {state.api_key}"
    body = {"hashes": [hash_hex(h) for h in hashes]}

    async def held(client: httpx.AsyncClient, source: str) -> int:
        try:
            resp = await client.post(source + LOOKUP_PATH, json=body, headers=headers)
            return int(resp.json()["cached"]) if resp.status_code == 200 else 0
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.info("kv_lookup_failed source=%s error=%r", source, exc)
            return 0

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout)) as client:
        counts = await asyncio.gather(*(held(client, s) for s in sources))
    pairs = zip(counts, sources, strict=True)
    ranked = sorted((-count, i, s) for i, (count, s) in enumerate(pairs) if count > 0)
    return [s for _, _, s in ranked]


async def remote_prefill(
    state: ServingState,
    params: KVTransferParams,
    request: EngineRequest,
    tokens: list[int],
    held: int,
    usable: int,
) -> int:
    """Disaggregated P/D, the decode side: have `params.remote_prefill` compute the prompt's
    blocks this cache lacks and stream them here as each is written (`kv_prefill`). Below
    the threshold of uncached tokens, or on any failure or past the deadline, the rest is
    recomputed here: the output is the same, only slower."""
    store = state.kv_store
    assert store is not None and params.remote_prefill is not None
    bs = store.block_size
    if len(tokens) - held * bs < params.prefill_threshold or held >= usable:
        state.engine.metrics.kv_transfer.fallback("below_threshold")
        return 0
    adapter = request.lora.identity if request.lora is not None else None
    hashes = chain(root_hash(adapter, request.cache_salt), tokens[: usable * bs], bs)
    body = {
        "prompt_token_ids": tokens[: usable * bs],
        "adapter": request.lora.name if request.lora is not None else None,
        "cache_salt": request.cache_salt,
        "compute": True,
        "start_block": held,
    }
    deadline = time.monotonic() + params.deadline_s
    source = params.remote_prefill.rstrip("/")
    first = chain_start(hashes, adapter)
    got = await pull_from(state, store, source, hashes[held:], adapter, deadline, body, first)
    if held + got < usable:
        state.engine.metrics.kv_transfer.fallback("incomplete" if got else "nothing_pulled")
    return got


async def pull_from(
    state: ServingState,
    store: KVStore,
    source: str,
    hashes: list[int],
    adapter: int | None,
    deadline: float,
    body: dict[str, Any] | None = None,
    first: int | None = None,
) -> int:
    """Blocks of `hashes` (from the first) pulled from one source and published here;
    `body` asks the source to compute them first (P/D), else they are held there. `first`:
    the hash of the chain's first block, when the caller knows it (`chain_start`): marked
    so this engine's hot list offers the chain on (`kv_warm`)."""
    started = time.monotonic()
    reader = WireReader(store.fingerprint, store.block_size, store.bytes_per_block, hashes)
    committed, reason = 0, None
    if body is None:
        body = {"hashes": [hash_hex(h) for h in hashes], "adapter_identity": adapter}
    try:
        committed = await _stream_into(state, store, source, body, reader, deadline, first)
    except TimeoutError:
        reason = "deadline"
    except WireError as exc:
        reason = exc.code
        reader.leftover += exc.blocks
    except _Refused as exc:
        reason = exc.reason
    except httpx.HTTPError as exc:
        reason = "source_error"
        log.info("kv_pull_failed source=%s error=%r", source, exc)
    committed += await import_blocks(state.engine, store, reader.leftover, first)
    outcome: Outcome = "ok" if committed == len(hashes) else "partial" if committed else "failed"
    if reason is not None:
        state.engine.metrics.kv_transfer.fallback(reason)
    seconds = time.monotonic() - started
    nbytes = committed * store.bytes_per_block
    computed = "compute" in body  # P/D: the time is mostly the source's compute, not the wire
    if committed >= WINDOW_BLOCKS and not computed:  # enough to measure the path itself
        store.pull_rate.update(nbytes / max(seconds, 1e-6))
    state.engine.metrics.kv_transfer.transfer("import", outcome, committed, nbytes, seconds)
    log.info(
        "kv_pull source=%s asked=%d committed=%d seconds=%.3f reason=%s",
        source, len(hashes), committed, seconds, reason,
    )  # fmt: skip
    return committed


class _Refused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def _stream_into(
    state: ServingState,
    store: KVStore,
    source: str,
    body: dict[str, Any],
    reader: WireReader,
    deadline: float,
    first: int | None,
) -> int:
    """Read the export stream, publishing each full window as it verifies; the verified
    tail of an unfinished window is left in `reader.leftover` for the caller to publish."""
    headers = {FINGERPRINT_HEADER: store.fingerprint}
    if state.api_key:
        headers["Authorization"] = f"Bearer {state.api_key}"
    remaining = max(0.001, deadline - time.monotonic())
    committed = 0
    reader.leftover = []
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(remaining)) as client,
        client.stream("POST", source + EXPORT_PATH, json=body, headers=headers) as resp,
    ):
        if resp.status_code != 200:
            reason = "fingerprint_mismatch" if resp.status_code == 409 else "source_error"
            raise _Refused(reason)
        chunks = resp.aiter_raw()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            try:
                chunk = await asyncio.wait_for(anext(chunks), remaining)
            except StopAsyncIteration:
                return committed
            reader.leftover += reader.feed(chunk)
            if len(reader.leftover) >= WINDOW_BLOCKS:
                window: list[VerifiedBlock] = reader.leftover
                reader.leftover = []
                got = await import_blocks(state.engine, store, window, first)
                committed += got
                if got < len(window):
                    raise _Refused("pool_full")
