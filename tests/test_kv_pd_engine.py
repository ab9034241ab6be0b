"""Disaggregated prefill/decode between two real engines (SmolLM2, in process, loopback HTTP).

Engine D, asked with `kv_transfer_params.remote_prefill`, has engine P compute the prompt
(`export` with `compute: true`, a prefill-only sequence streamed block by block), imports the
blocks and only computes the last partial block and the output. Its output must equal the
same request computed cold on one engine, token for token, greedy and seeded (temperature 1),
in float32 and int8 caches (batch-invariant mode, the CPU default); a P that dies mid-export
leaves D the verified prefix and D recomputes the rest with the same output.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from servefleet.api.kv_blocks import chain, root_hash
from servefleet.api.kv_transfer import EXPORT_PATH, LOOKUP_PATH, MAX_PREFILL_EXPORTS, hash_hex
from servefleet.bench import processes
from servefleet.engine.kv_wire import WireReader
from servefleet.engine.process import BuiltEngine
from tests.support.engine_harness import running_engine
from tests.support.export_proxy import export_proxy
from tests.support.http_server import serve_in_thread

MODEL = "smollm2-135m-instruct"
KEY = "pd-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = " ".join(f"Entry {i}: the ferry left pier {i * 5 % 11} at dawn." for i in range(32))
SETTINGS = {"api_key": KEY, "kv_cache_memory": "96MiB", "max_num_batched_tokens": 128}

Pair = tuple[BuiltEngine, str, BuiltEngine, str]


@pytest.fixture(scope="module", params=["float32", "int8"])
def pair(request: pytest.FixtureRequest, smollm2: Any) -> Iterator[Pair]:
    settings = {**SETTINGS, "kv_cache_dtype": request.param}
    with ExitStack() as stack:
        p = stack.enter_context(running_engine(smollm2, **settings))
        d = stack.enter_context(running_engine(smollm2, **settings))
        p.state.api_key = d.state.api_key = KEY
        yield p, stack.enter_context(serve_in_thread(p)), d, stack.enter_context(serve_in_thread(d))


def complete(url: str, sampling: dict[str, Any], **extra: Any) -> tuple[list[int], int, int]:
    """(token ids, prompt tokens, cached tokens) of a streamed completion."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, **sampling}
    body |= {"ignore_eos": True, "return_token_ids": True, "stream": True, **extra}
    body["stream_options"] = {"include_usage": True}
    ids: list[int] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    ids += choice["token_ids"]
    return ids, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def reset(*engines: BuiltEngine) -> None:
    async def go(built: BuiltEngine) -> None:
        await built.engine.call(built.kv_cache.pool.reset_prefix_cache)

    for built in engines:
        asyncio.run(go(built))


def prompt_ids(url: str) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}, headers=AUTH)
    return list(r.json()["tokens"])


GREEDY = {"temperature": 0}
SEEDED = {"temperature": 1.0, "seed": 1234}


def colocated_prefix_hit(url: str, sampling: dict[str, Any]) -> list[int]:
    """The request on one engine whose prefix cache already holds the prompt's full
    blocks: the path a P/D decode takes (it computes only the last partial block)."""
    ids = prompt_ids(url)
    warm = {"model": MODEL, "prompt": ids[: (len(ids) - 1) // 16 * 16], "max_tokens": 1}
    assert httpx.post(url + "/v1/completions", json=warm, headers=AUTH, timeout=180).is_success
    return complete(url, sampling)[0]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_pd_output_equals_colocated(pair: Pair, sampling: dict[str, Any]) -> None:
    p, p_url, d, d_url = pair
    reset(p, d)
    cold, prompt_tokens, cached = complete(d_url, sampling)
    assert cached == 0 and prompt_tokens > 300
    reset(p, d)
    hit = colocated_prefix_hit(d_url, sampling)
    reset(p, d)
    params = {"remote_prefill": p_url, "deadline_s": 60}
    pd, _, cached = complete(d_url, sampling, kv_transfer_params=params)
    # batch-invariant mode (the CPU default): neither the cache nor the chunking changes a
    # logit, so greedy and seeded alike equal a cold single engine (issues 26 and 27)
    assert d.loaded.model.attn_impl.per_row_prefill
    assert pd == hit == cold
    assert prompt_tokens - 16 <= cached < prompt_tokens  # D computed only the last block
    # P holds the prompt's blocks (a later D could pull them) and nothing stays pinned
    ids = prompt_ids(p_url)
    hashes = [hash_hex(h) for h in chain(root_hash(None), ids[: len(ids) - 1], 16)]
    r = httpx.post(p_url + LOOKUP_PATH, json={"hashes": hashes}, headers=AUTH)
    assert r.json() == {"cached": len(hashes)}
    metrics = httpx.get(p_url + "/metrics").text
    assert (
        'blocks_total{direction="export",model_name="smollm2-135m-instruct",outcome="ok"}'
        in metrics
    )
    p.kv_cache.check_all_free()
    d.kv_cache.check_all_free()


def test_a_prefill_engine_that_dies_mid_export_leaves_d_to_recompute(pair: Pair) -> None:
    p, p_url, d, d_url = pair
    reset(p, d)
    expected, _, _ = complete(d_url, GREEDY)
    reset(p, d)
    store = p.state.kv_store
    assert store is not None
    cut = 4 * store.bytes_per_block + store.bytes_per_block // 3  # mid-frame, 4 blocks in
    with processes.serve_in_thread(export_proxy(p_url, cut_after=cut), lifespan="off") as proxy:
        params = {"remote_prefill": proxy, "deadline_s": 60}
        got, _, cached = complete(d_url, GREEDY, kv_transfer_params=params)
    assert got == expected
    assert 0 < cached <= 4 * 16
    assert "servefleet_engine_kv_import_fallbacks_total" in httpx.get(d_url + "/metrics").text
    p.kv_cache.check_all_free()
    d.kv_cache.check_all_free()


def test_an_unreachable_prefill_engine_means_recompute(pair: Pair) -> None:
    _, _, d, d_url = pair
    reset(d)
    expected, _, _ = complete(d_url, GREEDY)
    reset(d)
    params = {"remote_prefill": "http://127.0.0.1:9", "deadline_s": 5}
    got, _, cached = complete(d_url, GREEDY, kv_transfer_params=params)
    assert got == expected and cached == 0
    d.kv_cache.check_all_free()


def test_below_the_threshold_d_prefills_itself(pair: Pair) -> None:
    p, p_url, d, d_url = pair
    reset(p, d)
    params = {"remote_prefill": p_url, "prefill_threshold": 100_000}
    _, _, cached = complete(d_url, GREEDY, kv_transfer_params=params)
    assert cached == 0
    ids = prompt_ids(p_url)
    hashes = [hash_hex(h) for h in chain(root_hash(None), ids[:16], 16)]
    r = httpx.post(p_url + LOOKUP_PATH, json={"hashes": hashes}, headers=AUTH)
    assert r.json() == {"cached": 0}  # P never computed it


def test_prefill_and_export_streams_every_full_block(pair: Pair) -> None:
    p, p_url, _, _ = pair
    reset(p)
    ids = prompt_ids(p_url)
    store = p.state.kv_store
    assert store is not None
    hashes = chain(root_hash(None), ids[: len(ids) // 16 * 16], 16)
    body = {"prompt_token_ids": ids, "compute": True, "start_block": 2}
    r = httpx.post(p_url + EXPORT_PATH, json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    reader = WireReader(store.fingerprint, 16, store.bytes_per_block, hashes[2:])
    blocks = reader.feed(r.content)
    assert reader.complete and [b.block_hash for b in blocks] == hashes[2:]
    # cached now: a second export streams the same blocks without computing
    r = httpx.post(p_url + EXPORT_PATH, json=body, headers=AUTH, timeout=120)
    again = WireReader(store.fingerprint, 16, store.bytes_per_block, hashes[2:])
    assert [b.data for b in again.feed(r.content)] == [b.data for b in blocks]
    p.kv_cache.check_all_free()


def test_prefill_and_export_refusals(pair: Pair) -> None:
    p, p_url, _, d_url = pair
    ids = prompt_ids(p_url)
    url = p_url + EXPORT_PATH
    body: dict[str, Any] = {"prompt_token_ids": ids, "compute": True}
    assert httpx.post(url, json=body).status_code == 401
    r = httpx.post(url, json={**body, "prompt_token_ids": [10**9] * 32}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_token_ids"
    r = httpx.post(url, json={**body, "prompt_token_ids": ids[:5]}, headers=AUTH)
    assert r.status_code == 400 and "one block" in r.json()["error"]["message"]
    r = httpx.post(url, json={**body, "adapter": "no-such-adapter"}, headers=AUTH)
    assert r.status_code == 404
    r = httpx.post(url, json={**body, "compute": False}, headers=AUTH)
    assert r.status_code == 400
    store = p.state.kv_store
    assert store is not None
    store.prefilling += MAX_PREFILL_EXPORTS
    try:
        r = httpx.post(url, json=body, headers=AUTH)
        assert r.status_code == 429 and r.json()["error"]["code"] == "prefill_busy"
    finally:
        store.prefilling -= MAX_PREFILL_EXPORTS
    # the decode side checks the prefill engine like any KV source
    chat = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for source in ("http://8.8.8.8:8000", "http://example.com"):
        chat["kv_transfer_params"] = {"remote_prefill": source}
        r = httpx.post(d_url + "/v1/completions", json=chat, headers=AUTH)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "kv_transfer_params.remote_prefill"
    chat["kv_transfer_params"] = {}
    r = httpx.post(d_url + "/v1/completions", json=chat, headers=AUTH)
    assert r.status_code == 400
