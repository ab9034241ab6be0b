"""Scale-up warm start on real engines (SmolLM2, in process, over loopback HTTP).

A peer's hot list names its cached chains, hottest (least evictable) first, within a
budget. A new engine whose `/ready` says kv-warming pulls those chains when asked to warm,
then is ready, and its first request on a hot prefix is a cache hit with the same tokens.
Without a warm call it is ready after its bound; a warm naming no source makes it ready at
once; every path needs the engine key and sources inside --kv-peer-networks. A salted chain
an engine only holds because it pulled it (a prefix pull, a P/D prefill, a warm start) is
offered on by its own hot list, so a third engine warming from it alone gets it too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from servefleet.api.kv_blocks import chain, root_hash
from servefleet.api.kv_warm import HOT_PATH, WARM_PATH, WARMING_DETAIL
from servefleet.engine.block_pool import BlockPool
from servefleet.engine.kv_warm import hot_chains
from servefleet.engine.kv_warm_gate import WarmGate
from servefleet.engine.process import BuiltEngine
from tests.support.engine_harness import running_engine
from tests.support.http_server import serve_in_thread
from tests.test_kv_transfer_engine import AUTH, KEY, SETTINGS, complete, reset

Pair = tuple[BuiltEngine, str, BuiltEngine, str]


def _cache(pool: BlockPool, tokens: list[int], parent: int | None = None) -> list[int]:
    """Cache `tokens` as a chain (blocks of 4) and free it; the chain's hashes."""
    hashes = chain(root_hash(None) if parent is None else parent, tokens, 4)
    blocks = pool.allocate(len(hashes))
    prev = root_hash(None) if parent is None else parent
    for block, h, i in zip(blocks, hashes, range(len(hashes)), strict=True):
        pool.cache_block(block, h, prev, tuple(tokens[i * 4 : i * 4 + 4]))
        prev = h
    pool.free(reversed(blocks))
    return hashes


def test_hot_chains_hottest_first_shared_blocks_once_and_bounded() -> None:
    pool = BlockPool(32)
    old = _cache(pool, list(range(8)))  # two blocks, freed first: the coldest
    shared = _cache(pool, list(range(100, 108)))
    tail = _cache(pool, list(range(200, 208)), parent=shared[-1])  # shared + its own tail
    held = pool.allocate(1)[0]  # an in-use cached chain is the hottest of all
    (h,) = chain(root_hash(None), [7, 7, 7, 7], 4)
    pool.cache_block(held, h, root_hash(None), (7, 7, 7, 7))
    assert hot_chains(pool, 100, 10) == [[h], shared + tail, old]
    # a chain whose root was evicted is not named; a block shared by two chains counts once
    assert hot_chains(pool, 3, 10) == [[h], shared]
    assert hot_chains(pool, 100, 2) == [[h], shared + tail]
    pool.free([held])
    pool.allocate(pool.num_free_blocks - 6)  # uncached blocks first, then the LRU: `old`
    pool.allocate(1)  # evicts old's first block: its leaf has no chain to the root now
    assert hot_chains(pool, 100, 10) == [[h], shared + tail]


@pytest.fixture(scope="module")
def pair(smollm2: Any) -> Iterator[Pair]:
    with ExitStack() as stack:
        a = stack.enter_context(running_engine(smollm2, **SETTINGS))
        b = stack.enter_context(running_engine(smollm2, **SETTINGS))
        a.state.api_key = b.state.api_key = KEY
        yield a, stack.enter_context(serve_in_thread(a)), b, stack.enter_context(serve_in_thread(b))


@pytest.fixture(scope="module")
def third(smollm2: Any) -> Iterator[tuple[BuiltEngine, str]]:
    with ExitStack() as stack:
        c = stack.enter_context(running_engine(smollm2, **SETTINGS))
        c.state.api_key = KEY
        yield c, stack.enter_context(serve_in_thread(c))


def _hot(url: str) -> set[tuple[str, ...]]:
    r = httpx.post(url + HOT_PATH, json={}, headers=AUTH)
    assert r.status_code == 200, r.text
    return {tuple(chain["hashes"]) for chain in r.json()["chains"]}


def _warm(built: BuiltEngine, url: str, source: str) -> int:
    built.state.kv_warm = WarmGate(600.0)
    r = httpx.post(url + WARM_PATH, json={"sources": [source]}, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return int(r.json()["blocks"])


def _ready(url: str) -> tuple[int, str | None]:
    r = httpx.get(url + "/ready")
    return r.status_code, r.json().get("detail")


def test_a_warmed_engine_serves_the_hot_prefix_from_its_cache(pair: Pair) -> None:
    a, a_url, b, b_url = pair
    reset(a), reset(b)
    expected, prompt_tokens, _ = complete(a_url)
    b.state.kv_warm = WarmGate(600.0)
    assert _ready(b_url) == (503, WARMING_DETAIL)
    assert httpx.post(b_url + WARM_PATH, json={"sources": [a_url]}).status_code == 401
    r = httpx.post(b_url + WARM_PATH, json={"sources": [a_url]}, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    result = r.json()
    assert result["blocks"] == result["sources"][a_url] > 0
    assert _ready(b_url) == (200, None)
    got, _, cached = complete(b_url)
    assert got == expected
    assert cached >= (prompt_tokens - 1) // 16 * 16 - 16  # the prompt's blocks, pulled
    r = httpx.post(b_url + WARM_PATH, json={"sources": [a_url]}, headers=AUTH)
    assert r.status_code == 409  # warmed once: never again
    a.kv_cache.check_all_free()
    b.kv_cache.check_all_free()


def test_no_source_means_ready_at_once_and_the_bound_holds(pair: Pair) -> None:
    _, _, b, b_url = pair
    b.state.kv_warm = WarmGate(600.0)
    r = httpx.post(b_url + WARM_PATH, json={"sources": []}, headers=AUTH)
    assert r.status_code == 200 and r.json()["blocks"] == 0
    assert _ready(b_url) == (200, None)
    b.state.kv_warm = WarmGate(0.05)  # nobody warms it: ready after the bound anyway
    b.state.kv_warm.opened_at -= 1.0
    assert _ready(b_url) == (200, None)


def test_warm_sources_and_bodies_are_checked(pair: Pair) -> None:
    _, a_url, b, b_url = pair
    b.state.kv_warm = WarmGate(600.0)
    for source in ("http://8.8.8.8:8000", "http://example.com:80", "file:///etc/passwd"):
        r = httpx.post(b_url + WARM_PATH, json={"sources": [source]}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "sources", r.text
    r = httpx.post(b_url + WARM_PATH, json={"sources": [], "max_blocks": -1}, headers=AUTH)
    assert r.status_code == 400
    r = httpx.post(b_url + WARM_PATH, json={"sources": [], "extra": 1}, headers=AUTH)
    assert r.status_code == 400
    assert _ready(b_url) == (503, WARMING_DETAIL)  # nothing accepted: still warming
    assert httpx.post(a_url + HOT_PATH, json={}).status_code == 401
    assert httpx.post(a_url + HOT_PATH, json={}, headers=AUTH).status_code == 200
    r = httpx.post(a_url + HOT_PATH, json={"max_blocks": 0}, headers=AUTH)
    assert r.status_code == 400
    b.state.kv_warm = None


def test_the_gate_ends_at_its_bound_or_when_a_warm_finishes() -> None:
    gate = WarmGate(10.0, opened_at=100.0)
    assert gate.warming(105.0)
    assert not gate.warming(110.0) and not gate.warming(105.0)  # timed out: for good
    gate = WarmGate(10.0, opened_at=time.monotonic())
    gate.begin(60.0)  # a warm under way holds it past the bound, up to its own deadline
    assert gate.warming(gate.opened_at + 30.0)
    assert not gate.warming(gate.opened_at + 61.0)
    gate.finish()
    assert not gate.warming()


def test_a_pulled_salted_chain_is_offered_on_to_the_next_warm_start(
    pair: Pair, third: tuple[BuiltEngine, str]
) -> None:
    a, a_url, b, b_url = pair
    c, c_url = third
    salt = {"cache_salt": "tenant-7"}
    reset(a), reset(b), reset(c)
    expected, prompt_tokens, _ = complete(a_url, **salt)
    full = (prompt_tokens - 1) // 16 * 16 - 16
    _, _, cached = complete(b_url, kv_transfer_params={"kv_sources": [a_url]}, **salt)
    assert cached >= full  # B holds the salted chain only because it pulled it
    assert _hot(b_url) == _hot(a_url) != set()  # and offers it as A does
    assert _warm(c, c_url, b_url) > 0  # C, warmed from B alone, gets it
    got, _, cached = complete(c_url, **salt)
    assert got == expected and cached >= full
    reset(a), reset(b)
    assert _warm(b, b_url, c_url) > 0  # C holds it only by a warm start: offered on too
    assert _hot(b_url) == _hot(c_url) != set()
    reset(b)  # P/D: B has A compute the prompt and stream its blocks
    params = {"remote_prefill": a_url, "deadline_s": 60}
    got, _, cached = complete(b_url, kv_transfer_params=params, **salt)
    assert got == expected and cached >= full
    (a_chain,) = _hot(a_url)
    assert any(c[: len(a_chain)] == a_chain for c in _hot(b_url))
    for built in (a, b, c):
        built.kv_cache.check_all_free()
