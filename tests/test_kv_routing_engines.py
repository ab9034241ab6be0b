"""Routing by cache contents across two real engines (SmolLM2, in process, loopback HTTP).

The gateway's pool follows both engines' KV event streams. A long prompt computed on A shows
up in the index as A's; while A is idle the pool sends the prompt back to A, and when A has
a long queue the pool sends it to B with A as the KV source, and B's answer (which pulled the
prefix) equals A's with pulled blocks counted as cached.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from servefleet.api.cache_salt import tenant_salt
from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    RoutingConfig,
    SecretValueRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.kv_blocks import root_hash
from servefleet.bench.processes import serve_in_thread as serve_app
from servefleet.gateway.app import Gateway
from servefleet.gateway.kv_pull import kv_pull_params
from servefleet.gateway.kv_subscriber import KVSubscriber
from servefleet.gateway.pool import DeploymentPool, Lease, PoolRequest
from servefleet.gateway.queueing import TrafficClass
from servefleet.gateway.token_counter import load_token_counter
from tests.support.engine_harness import running_engine
from tests.support.http_server import serve_in_thread

MODEL = "smollm2-135m-instruct"
KEY = "route-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = " ".join(f"Entry {i}: the orchard has {i * 5 % 17} pear trees." for i in range(28))
SETTINGS = {"api_key": KEY, "kv_cache_memory": "64MiB", "max_num_batched_tokens": 256}


@pytest.fixture(scope="module")
def urls(smollm2: Any) -> Iterator[tuple[str, str]]:
    with ExitStack() as stack:
        a = stack.enter_context(running_engine(smollm2, **SETTINGS))
        b = stack.enter_context(running_engine(smollm2, **SETTINGS))
        a.state.api_key = b.state.api_key = KEY
        yield stack.enter_context(serve_in_thread(a)), stack.enter_context(serve_in_thread(b))


def complete(url: str, **extra: Any) -> tuple[str, int]:
    """(text, cached prompt tokens) of a short greedy completion."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip
    resp = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def _pool(a: str, b: str) -> DeploymentPool:
    config = GatewayDeployment.model_validate(
        {"name": "d", "model": MODEL, "tenants": [{"name": "t"}], "endpoints": [a, b],
         "engine_api_key": {"value": KEY}, "pool": {"perReplicaConcurrency": 4}}
    )  # fmt: skip
    pool = DeploymentPool(config, RoutingConfig(affinity_slack=8))
    pool.set_replicas([a, b], ready=[a, b])
    return pool


async def _wait_for(check: Any, what: str, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_busy_holders_prefix_is_pulled_by_the_idle_replica(urls: tuple[str, str]) -> None:
    a, b = urls
    counted = load_token_counter(MODEL).completion_counted(PROMPT, 16)
    assert counted is not None and len(counted.block_hashes) >= 16
    hashes = counted.block_hashes
    pool = _pool(a, b)
    follower = asyncio.create_task(KVSubscriber(pool).run(interval_s=0.1))
    try:
        await _wait_for(lambda: len(pool.kv_index.per_replica) == 2, "both hellos")
        on_a, _ = await asyncio.to_thread(complete, a)
        await _wait_for(lambda: pool.kv_index.held_runs(hashes).get(a) == len(hashes), "A's blocks")
        assert b not in pool.kv_index.held_runs(hashes)
        request = PoolRequest("t", TrafficClass.INTERACTIVE, 1.0, 600, None, block_hashes=hashes)
        first = await pool.acquire(request)
        assert isinstance(first, Lease) and first.replica.endpoint == a and first.kv_source is None
        pool.release(first, ok=True)
        pool.replicas.replicas[a].outstanding_tokens += 20_000  # a long queue on the holder
        second = await pool.acquire(request)
        assert isinstance(second, Lease) and second.replica.endpoint == b
        assert second.kv_source == a
        fields = kv_pull_params(pool.config, second, counted.tokens)
        on_b, cached = await asyncio.to_thread(complete, b, **json.loads(json.dumps(fields)))
        assert on_b == on_a
        # B held nothing: every cached token was pulled (all of it, unless the pull ran
        # past its deadline, when B keeps the verified part and recomputes the rest).
        assert cached >= 4 * 16 and cached % 16 == 0
        # B now holds the prefix too, and says so.
        await _wait_for(lambda: pool.kv_index.held_runs(hashes).get(b, 0) >= 16, "B's blocks")
        assert pool.kv_decisions.get("pull") == 1 and pool.kv_decisions.get("go_to_holder") == 1
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)


def test_the_gateway_hashes_prompts_and_sends_them_to_their_holder(urls: tuple[str, str]) -> None:
    """Through the gateway's HTTP path: counted and hashed at admission, routed by contents."""
    a, b = urls
    config = GatewayConfig(
        tenants=[GatewayTenant(name="t", api_keys=[ApiKeyRef(sha256=hash_api_key("key-t"))])],
        deployments=[
            GatewayDeployment(
                name="m", model=MODEL, tenants=[TenantAccess(name="t")], tokenizer=MODEL,
                engine_api_key=SecretValueRef(value=SecretStr(KEY)),
            )
        ],
    )  # fmt: skip
    gateway = Gateway(config)
    gateway.set_replicas("m", [a, b], ready=[a, b])
    pool = gateway.pools["m"]
    prompt = PROMPT.replace("orchard", "vineyard")  # not cached anywhere yet
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    salted = root_hash(None, tenant_salt("t", None))  # the engines cache under t's salt
    counted = load_token_counter(MODEL).completion_counted(prompt, 16, salted)
    assert counted is not None
    hashes = counted.block_hashes
    with serve_app(gateway) as base:
        deadline = time.monotonic() + 60
        while pool.token_counter is None or len(pool.kv_index.per_replica) < 2:
            assert time.monotonic() < deadline, "tokenizer or event streams not ready"
            time.sleep(0.05)

        def ask() -> dict[str, Any]:
            headers = {"authorization": "Bearer key-t"}
            reply = httpx.post(base + "/v1/completions", headers=headers, json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            return dict(reply.json())

        ask()
        assert pool.kv_decisions == {"local": 1}  # hashed; nobody held it yet
        while not pool.kv_index.held_runs(hashes):
            assert time.monotonic() < deadline, "the holder's events never arrived"
            time.sleep(0.05)
        (holder,) = pool.kv_index.held_runs(hashes)
        second = ask()
    assert pool.kv_decisions == {"local": 1, "go_to_holder": 1}
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(hashes) * 16 - 16
    assert holder in (a, b)
