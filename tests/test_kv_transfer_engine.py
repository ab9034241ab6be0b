"""KV transfer between two real engines (SmolLM2, in process, over loopback HTTP).

Engine A computes a long prompt; engine B, asked with `kv_transfer_params`, pulls the
prompt's blocks from A instead of computing them, and its greedy output equals A's and a
recomputing B's. A source that dies halfway leaves B the verified prefix, and B recomputes
the rest with the same output. The endpoints need the engine key, refuse another cache's
fingerprint, and a pull only goes to --kv-peer-networks.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from servefleet.api.kv_blocks import chain, root_hash
from servefleet.api.kv_transfer import (
    EXPORT_PATH,
    FINGERPRINT_HEADER,
    IMPORT_PATH,
    INFO_PATH,
    LOOKUP_PATH,
    hash_hex,
)
from servefleet.bench import processes
from servefleet.engine.process import BuiltEngine
from tests.support.engine_harness import running_engine
from tests.support.export_proxy import export_proxy
from tests.support.http_server import serve_in_thread

MODEL = "smollm2-135m-instruct"
KEY = "kv-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = " ".join(f"Item {i}: the lighthouse keeper counted {i * 7 % 13} gulls." for i in range(30))
SETTINGS = {"api_key": KEY, "kv_cache_memory": "96MiB", "max_num_batched_tokens": 256}

Pair = tuple[BuiltEngine, str, BuiltEngine, str]


@pytest.fixture(scope="module", params=["float32", "int8"])
def pair(request: pytest.FixtureRequest, smollm2: Any) -> Iterator[Pair]:
    settings = {**SETTINGS, "kv_cache_dtype": request.param}
    with ExitStack() as stack:
        a = stack.enter_context(running_engine(smollm2, **settings))
        b = stack.enter_context(running_engine(smollm2, **settings))
        a.state.api_key = b.state.api_key = KEY
        yield a, stack.enter_context(serve_in_thread(a)), b, stack.enter_context(serve_in_thread(b))


def complete(url: str, **extra: Any) -> tuple[list[int], int, int]:
    """(token ids, prompt tokens, cached tokens) of a greedy completion."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True, "stream": True, **extra}
    body["stream_options"] = {"include_usage": True}
    ids: list[int] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    ids += choice["token_ids"]
    return ids, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def reset(built: BuiltEngine) -> None:
    """Forget every cached block (between steps: the engine thread owns the pool)."""

    async def go() -> None:
        await built.engine.call(built.kv_cache.pool.reset_prefix_cache)

    asyncio.run(go())


def test_a_pulled_prefix_gives_the_same_output(pair: Pair) -> None:
    a, a_url, b, b_url = pair
    reset(a)
    reset(b)
    recomputed, prompt_tokens, cached = complete(b_url)
    assert cached == 0 and prompt_tokens > 400
    reset(b)
    on_a, _, _ = complete(a_url)
    pulled, _, cached = complete(b_url, kv_transfer_params={"kv_sources": [a_url]})
    assert pulled == on_a == recomputed
    assert prompt_tokens - 16 <= cached < prompt_tokens
    metrics = httpx.get(b_url + "/metrics").text
    assert 'servefleet_engine_kv_transfer_blocks_total{direction="import"' in metrics
    a.kv_cache.check_all_free()
    b.kv_cache.check_all_free()


def test_a_source_that_dies_halfway_leaves_a_verified_prefix(pair: Pair) -> None:
    a, a_url, b, b_url = pair
    reset(a)
    reset(b)
    expected, prompt_tokens, _ = complete(a_url)
    store = a.state.kv_store
    assert store is not None
    cut = 5 * store.bytes_per_block + store.bytes_per_block // 2  # mid-frame, ~5 blocks in
    with processes.serve_in_thread(export_proxy(a_url, cut_after=cut), lifespan="off") as proxy:
        got, _, cached = complete(b_url, kv_transfer_params={"kv_sources": [proxy]})
    assert got == expected
    assert 0 < cached < prompt_tokens - 16
    assert cached % 16 == 0
    metrics = httpx.get(b_url + "/metrics").text
    assert "servefleet_engine_kv_import_fallbacks_total" in metrics
    b.kv_cache.check_all_free()


def test_a_pushed_stream_is_imported_up_to_its_last_whole_block(pair: Pair) -> None:
    a, a_url, b, b_url = pair
    reset(a)
    reset(b)
    complete(a_url)
    r = httpx.post(a_url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}, headers=AUTH)
    ids = r.json()["tokens"]
    hashes = [hash_hex(h) for h in chain(root_hash(None), ids[: len(ids) - 1], 16)]
    stream = httpx.post(a_url + EXPORT_PATH, json={"hashes": hashes}, headers=AUTH).content
    store = a.state.kv_store
    assert store is not None
    cut = 3 * store.bytes_per_block + 100  # under three whole frames: two blocks arrive
    r = httpx.post(b_url + IMPORT_PATH, content=stream[:cut], headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"committed": 2, "received": 2, "complete": False}
    r = httpx.post(b_url + IMPORT_PATH, content=stream, headers=AUTH)
    assert r.json() == {"committed": len(hashes), "received": len(hashes), "complete": True}
    r = httpx.post(b_url + LOOKUP_PATH, json={"hashes": hashes}, headers=AUTH)
    assert r.json() == {"cached": len(hashes)}
    bad = bytearray(stream)
    bad[-10] ^= 1
    reset(b)
    r = httpx.post(b_url + IMPORT_PATH, content=bytes(bad), headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "crc_mismatch"
    r = httpx.post(b_url + LOOKUP_PATH, json={"hashes": hashes}, headers=AUTH)
    assert r.json() == {"cached": len(hashes) - 1}  # every block before the bad one
    b.kv_cache.check_all_free()


def test_the_endpoints_need_the_key_and_the_same_fingerprint(pair: Pair) -> None:
    _, a_url, _, _ = pair
    assert httpx.get(a_url + INFO_PATH).status_code == 401
    assert httpx.post(a_url + LOOKUP_PATH, json={"hashes": ["0" * 32]}).status_code == 401
    info = httpx.get(a_url + INFO_PATH, headers=AUTH).json()
    assert len(info["fingerprint"]) == 64
    r = httpx.post(a_url + LOOKUP_PATH, json={"hashes": ["0" * 32]}, headers=AUTH)
    assert r.json() == {"cached": 0}
    wrong = {**AUTH, FINGERPRINT_HEADER: "f" * 64}
    r = httpx.post(a_url + EXPORT_PATH, json={"hashes": ["0" * 32]}, headers=wrong)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "kv_fingerprint_mismatch"
    r = httpx.post(a_url + LOOKUP_PATH, json={"hashes": ["xyz"]}, headers=AUTH)
    assert r.status_code == 400


def test_sources_outside_the_peer_networks_are_refused(pair: Pair) -> None:
    _, _, _, b_url = pair
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for source in ("http://8.8.8.8:8000", "http://example.com", "file:///etc/passwd"):
        body["kv_transfer_params"] = {"kv_sources": [source]}
        r = httpx.post(b_url + "/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "kv_transfer_params.kv_sources"


def _imported_blocks(url: str) -> float:
    found = re.findall(
        r'servefleet_engine_kv_transfer_blocks_total\{direction="import",[^}]*\} ([0-9.e+]+)',
        httpx.get(url + "/metrics").text,
    )
    return sum(float(n) for n in found)


def test_requests_missing_the_same_prefix_pull_it_once(pair: Pair) -> None:
    """A second request for a prefix another request is pulling waits for that pull and
    then finds the blocks here: the source exports once, the blocks are imported once."""
    a, a_url, b, b_url = pair
    reset(a)
    reset(b)
    expected, prompt_tokens, _ = complete(a_url)
    before = _imported_blocks(b_url)
    exports: list[int] = []
    params = {"kv_transfer_params": {"kv_sources": [], "deadline_s": 30.0}}
    with processes.serve_in_thread(
        export_proxy(a_url, delay_s=1.0, exports=exports), lifespan="off"
    ) as proxy:
        params["kv_transfer_params"]["kv_sources"] = [proxy]
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(complete, b_url, **params)
            time.sleep(0.4)  # inside the first pull's wait at the source
            second = pool.submit(complete, b_url, **params)
            answers = [first.result(), second.result()]
    assert [got for got, _, _ in answers] == [expected, expected]
    assert all(cached >= prompt_tokens - 16 for _, _, cached in answers)
    assert len(exports) == 1
    assert _imported_blocks(b_url) - before == (prompt_tokens - 1) // 16
    text = httpx.get(b_url + "/metrics").text
    joined = re.search(r"servefleet_engine_kv_pulls_joined_total\{[^}]*\} ([0-9.]+)", text)
    assert joined is not None and float(joined.group(1)) >= 1
    b.kv_cache.check_all_free()
