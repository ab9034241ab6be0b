"""Scale-up warm start, the engine's half: list this cache's hottest chains (`hot`), and
pull a peer's hottest chains into this cache before reporting ready (`warm`).

Hot is what the pool would evict last: blocks running sequences hold, then cached free
blocks, most recently freed first (the LRU order `block_pool` evicts by, front first). A
hot list names root → leaf chains, hottest leaf first, each chain only from the model's
root (adapter chains are skipped: their root needs the adapter's identity, which the
receiver may not hold), under a block and a chain budget; a block shared by several chains
counts once. The receiver pulls each chain's missing run with the same verified export
stream a prefix pull uses (`kv_puller.pull_from`), so nothing unverified becomes visible
and a slow or dead source costs at most the warm's deadline. It takes at most half of its
own pool, leaving the rest to the requests it is about to serve.
"""

from __future__ import annotations

import time
from collections import Counter
from functools import partial
from typing import TYPE_CHECKING

import httpx
from fastapi import FastAPI, Request

from servefleet.api.kv_blocks import root_hash
from servefleet.api.kv_transfer import FINGERPRINT_HEADER, MAX_LOOKUP_BODY_BYTES, hash_hex
from servefleet.api.kv_warm import (
    HOT_PATH,
    WARM_PATH,
    KVHotChain,
    KVHotList,
    KVHotRequest,
    KVWarmRequest,
    KVWarmResult,
)
from servefleet.api.openai_errors import OpenAIError
from servefleet.api.replica_endpoints import ReplicaTargets
from servefleet.engine.block_pool import BlockPool, KVBlock
from servefleet.engine.kv_puller import pull_from
from servefleet.engine.kv_routes import fingerprint_mismatch
from servefleet.engine.kv_store import KVStore
from servefleet.engine.request_checks import parse

if TYPE_CHECKING:
    from servefleet.engine.serving_state import ServingState

NOT_WARMING = "kv_not_warming"


def hot_chains(pool: BlockPool, max_blocks: int, max_chains: int) -> list[list[int]]:
    """The hottest cached chains (engine thread): root → leaf hashes, hottest leaf first."""
    cached = [b for b in pool.blocks if b.block_hash is not None]
    parents = {b.parent_hash for b in cached}
    # front of the free queue is evicted first; in-use blocks are not in it (hottest)
    free_rank = {block_id: i for i, block_id in enumerate(pool._free)}  # read only
    leaves = [b for b in cached if b.block_hash not in parents]
    leaves.sort(key=lambda b: (b.ref_count > 0, free_rank.get(b.block_id, -1)), reverse=True)
    base = root_hash(None)
    chains: list[list[int]] = []
    named: set[int] = set()
    for leaf in leaves:
        if len(chains) >= max_chains or len(named) >= max_blocks:
            break
        chain = _chain_to(pool, leaf, base)
        if chain is None:
            continue
        fresh = sum(1 for h in chain if h not in named)
        room = max_blocks - len(named)
        if fresh > room:  # what is named already is a prefix: keep as many new as fit
            chain = chain[: len(chain) - fresh + room]
        if fresh:
            named.update(chain)
            chains.append(chain)
    return chains


def _chain_to(pool: BlockPool, leaf: KVBlock, base: int) -> list[int] | None:
    """`leaf`'s chain from the model's root (salted or not), or None (an ancestor is gone, or
    an adapter's)."""
    chain = [leaf.block_hash or 0]
    block = leaf
    while block.parent_hash != base and not block.first:
        parent = pool.lookup(block.parent_hash or 0)
        if parent is None or len(chain) >= pool.num_blocks:
            return None
        chain.append(parent.block_hash or 0)
        block = parent
    chain.reverse()
    return chain


def _store(state: ServingState) -> KVStore:
    if state.kv_store is None or not state.kv_store.kv.enable_caching:
        raise OpenAIError(status=400, message="this engine keeps no prefix cache to warm")
    return state.kv_store


def check_sources(state: ServingState, sources: list[str]) -> None:
    """Sources are checked as `kv_sources` are: addresses inside --kv-peer-networks."""
    peers = ReplicaTargets(state.kv_peer_networks, frozenset(), "this engine's --kv-peer-networks")
    for source in sources:
        if (problem := peers.problem(source)) is not None:
            raise OpenAIError(status=400, message=f"sources: {source!r} {problem}", param="sources")


async def fetch_hot(
    state: ServingState, store: KVStore, source: str, max_blocks: int, deadline: float
) -> list[list[int]]:
    """A source's hot list (empty when it cannot give one: another fingerprint, down)."""
    headers = {FINGERPRINT_HEADER: store.fingerprint}
    if state.api_key:
        headers["Authorization"] = f"Bearer {state.api_key}"
    body = KVHotRequest(max_blocks=max_blocks).model_dump()
    timeout = max(0.001, deadline - time.monotonic())
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout)) as client:
            resp = await client.post(source + HOT_PATH, json=body, headers=headers)
        if resp.status_code != 200:
            return []
        hot = KVHotList.model_validate_json(resp.content)
    except (httpx.HTTPError, ValueError):
        return []
    return [[int(h, 16) for h in chain.hashes] for chain in hot.chains]


async def warm(state: ServingState, store: KVStore, body: KVWarmRequest) -> KVWarmResult:
    """Pull each source's hot chains (missing runs only) within the budget and deadline."""
    gate = state.kv_warm
    assert gate is not None
    started = time.monotonic()
    deadline = gate.begin(body.deadline_s)
    budget = min(body.max_blocks, store.kv.num_blocks // 2)
    pulled: Counter[str] = Counter()
    asked = 0
    try:
        for source in (s.rstrip("/") for s in body.sources):
            if budget <= 0 or time.monotonic() >= deadline:
                break
            for chain in await fetch_hot(state, store, source, budget, deadline):
                if budget <= 0 or time.monotonic() >= deadline:
                    break
                held = await state.engine.call(partial(store.held_run, chain))
                missing = chain[held:][:budget]
                if not missing:
                    continue
                asked += 1
                # the chain starts where the source's hot list says (`hot_chains`): a
                # salted root is not computable here (no salt), so that is the source's word
                got = await pull_from(state, store, source, missing, None, deadline, first=chain[0])
                budget -= got
                pulled[source] += got
    finally:
        gate.finish()
    seconds = time.monotonic() - started
    return KVWarmResult(
        blocks=sum(pulled.values()), chains=asked, seconds=seconds, sources=dict(pulled)
    )


def add_kv_warm_routes(app: FastAPI, state: ServingState) -> None:
    """`hot` and `warm`, behind the engine key (neither is in `api_key.OPEN_PATHS`)."""

    @app.post(HOT_PATH)
    async def hot(request: Request) -> KVHotList:
        store = _store(state)
        sent = request.headers.get(FINGERPRINT_HEADER)
        if sent is not None and sent != store.fingerprint:
            raise fingerprint_mismatch()
        body = await parse(request, KVHotRequest, MAX_LOOKUP_BODY_BYTES)
        fn = partial(hot_chains, store.kv.pool, body.max_blocks, body.max_chains)
        chains = await state.engine.call(fn)
        return KVHotList(chains=[KVHotChain(hashes=[hash_hex(h) for h in c]) for c in chains])

    @app.post(WARM_PATH)
    async def warm_route(request: Request) -> KVWarmResult:
        store = _store(state)
        body = await parse(request, KVWarmRequest, MAX_LOOKUP_BODY_BYTES)
        check_sources(state, body.sources)
        gate = state.kv_warm
        if gate is None or not gate.warming() or gate.pulling_until is not None:
            raise OpenAIError(
                status=409,
                message="this engine is not waiting to be warmed (ready, or a warm is under way)",
                type="conflict",
                code=NOT_WARMING,
            )
        return await warm(state, store, body)
