"""Routing adapter requests by cache contents: the gateway learns each replica's resident LoRA
adapters (name -> identity) from its KV events, and hashes an adapter's prompt from
`root_hash(identity, salt)` only while the replicas that report the name agree."""

from __future__ import annotations

import json
from contextlib import ExitStack
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from servefleet.api.gateway_config import GatewayAdapter, GatewayDeployment, RoutingConfig
from servefleet.api.kv_blocks import chain, root_hash
from servefleet.api.kv_events import KVEventBatch, KVHello, KVSnapshot
from servefleet.api.kv_transfer import hash_hex
from servefleet.api.openai_requests import CompletionRequest
from servefleet.bench.fake_upstream import FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.endpoints import chain_root, count_prompt
from servefleet.gateway.kv_index import KVIndex
from servefleet.gateway.kv_subscriber import apply_event
from servefleet.gateway.pool import DeploymentPool, Lease, PoolRequest
from servefleet.gateway.prompt import PromptReader
from servefleet.gateway.queueing import TrafficClass
from servefleet.gateway.token_counter import load_token_counter
from tests.support.gateway_rig import served_gateway

A, B, C = (f"http://10.0.0.{i}:8000" for i in range(3))
MODEL = "smollm2-135m-instruct"
ID1, ID2 = -(2**63), 2**63 - 1  # the extremes of a signed 64-bit identity
PROMPT = " ".join(f"Line {i}: the ferry leaves at {i % 12 + 1} o'clock." for i in range(12))


def hello(adapters: dict[str, int] | None = None, epoch: str = "e1") -> KVHello:
    return KVHello(epoch=epoch, block_size=16, num_blocks=1000, adapters=adapters)


def batch(seq: int, adapters: dict[str, int] | None = None) -> KVEventBatch:
    return KVEventBatch(seq=seq, ts=0.0, adapters=adapters)


def test_the_index_keeps_each_replicas_adapters_from_its_events() -> None:
    index = KVIndex()
    index.hello(A, hello({"x": ID1}))
    assert index.adapter_identity("x") == ID1 and index.adapter_identity("y") is None
    index.batch(A, batch(1))  # nothing said: kept
    index.snapshot(A, KVSnapshot(seq=1, stored=[]))
    assert index.adapter_identity("x") == ID1
    index.batch(A, batch(2, {"y": ID2}))  # x evicted, y loaded
    assert index.adapter_identity("x") is None and index.adapter_identity("y") == ID2
    index.hello(A, hello(None, epoch="e2"))  # restarted as an older engine: says nothing
    assert index.adapter_identity("y") is None
    index.drop(A)
    assert index.adapter_identity("y") is None


def test_an_older_engine_and_a_newer_one_are_both_understood() -> None:
    index = KVIndex()
    old = {"epoch": "e1", "block_size": 16, "num_blocks": 10}  # no adapters at all
    apply_event(index, A, "hello", json.dumps(old))
    apply_event(index, A, "batch", json.dumps({"seq": 1, "ts": 0.0}))
    assert index.replica(A) is not None and index.replica(A).adapters == {}  # type: ignore[union-attr]
    new = {**old, "adapters": {"x": ID1}, "said_later": [1, 2]}  # more than we know: ignored
    apply_event(index, B, "hello", json.dumps(new))
    assert index.adapter_identity("x") == ID1
    with pytest.raises(ValueError):  # not a 64-bit identity: the stream breaks, as any bad event
        apply_event(index, C, "hello", json.dumps({**old, "adapters": {"x": 2**64}}))


def test_replicas_must_agree_on_an_adapters_identity() -> None:
    index = KVIndex()
    index.hello(A, hello({"x": ID1}))
    index.hello(B, hello({"x": ID1, "y": 5}))
    index.hello(C, hello({}))  # does not hold x: no say
    assert index.adapter_identity("x") == ID1
    index.batch(C, batch(1, {"x": ID2}))  # other files under the same name
    assert index.adapter_identity("x") is None
    assert index.adapter_identity("y") == 5
    index.drop(C)
    assert index.adapter_identity("x") == ID1


def _route(adapter: str | None, index: KVIndex, counter: Any = None) -> Any:
    config = GatewayDeployment.model_validate(
        {"name": "d", "model": "m", "tenants": [{"name": "t"}], "kv_pull_min_tokens": 64}
    )
    pool = SimpleNamespace(config=config, kv_index=index, token_counter=counter)
    reader = PromptReader(chars_per_token=4.0, block_size=16, affinity_blocks=4)
    gateway_adapter = None if adapter is None else GatewayAdapter(name=adapter, path="/a")
    return SimpleNamespace(pool=pool, adapter=gateway_adapter, reader=reader)


def test_the_chain_root_is_the_adapters_once_its_replicas_agree() -> None:
    index = KVIndex()
    assert chain_root(_route(None, index), "s") == root_hash(None, "s")
    assert chain_root(_route("x", index), "s") is None  # nobody reported x: not hashed
    index.hello(A, hello({"x": ID1}))
    assert chain_root(_route("x", index), "s") == root_hash(ID1, "s")
    assert chain_root(_route("x", index), None) == root_hash(ID1)
    index.hello(B, hello({"x": ID2}))
    assert chain_root(_route("x", index), "s") is None


async def test_an_adapter_prompt_is_hashed_as_the_engine_chains_it() -> None:
    counter = load_token_counter(MODEL)
    index = KVIndex()
    route = _route("x", index, counter)
    parsed = {"model": "x", "prompt": PROMPT, "max_tokens": 2}
    request = CompletionRequest.model_validate(parsed)
    unknown = await count_prompt(route, request, parsed, "s")
    assert unknown.tokens > 64 and unknown.block_hashes == ()  # as before: affinity only
    index.hello(A, hello({"x": ID1}))
    known = await count_prompt(route, request, parsed, "s")
    ids = counter.tokenizer.encode(PROMPT)
    assert known.block_hashes == tuple(chain(root_hash(ID1, "s"), ids, 16))
    base = await count_prompt(_route(None, index, counter), request, parsed, "s")
    assert base.block_hashes == tuple(chain(root_hash(None, "s"), ids, 16))
    assert set(base.block_hashes).isdisjoint(known.block_hashes)


async def test_the_pool_routes_an_adapter_request_to_the_holder_of_its_blocks() -> None:
    config = GatewayDeployment.model_validate(
        {"name": "d", "model": "m", "tenants": [{"name": "t"}],
         "pool": {"perReplicaConcurrency": 4}}
    )  # fmt: skip
    pool = DeploymentPool(config, RoutingConfig(affinity_slack=8))
    pool.set_replicas([A, B], ready=[A, B])
    pool.replicas.replicas[A].adapters = {"x"}
    pool.replicas.replicas[B].adapters = {"x"}
    hashes = tuple(chain(root_hash(ID1), list(range(640)), 16))
    for endpoint in (A, B):
        pool.kv_index.hello(endpoint, hello({"x": ID1}))
    stored = [(hash_hex(h), hash_hex(0)) for h in hashes]
    pool.kv_index.snapshot(B, KVSnapshot(seq=1, stored=stored))
    for key in range(8):  # whatever the prompt's affinity says
        request = PoolRequest("t", TrafficClass.INTERACTIVE, 1.0, 700, key, None, "x", hashes)
        lease = await pool.acquire(request)
        assert isinstance(lease, Lease) and lease.replica.endpoint == B
        pool.release(lease, ok=True)
    assert pool.kv_decisions["go_to_holder"] == 8


@pytest.mark.parametrize("field", ["adapter_identity", "adapters"])
def test_attack_a_tenant_cannot_send_an_adapter_identity(field: str) -> None:
    """Identities come only from the engines' streams (engine key): a tenant's body naming
    one is refused, naming the field, and reaches no engine."""
    with ExitStack() as stack:
        fake = FakeOpenAI()
        url = stack.enter_context(serve_in_thread(fake))
        _, base = served_gateway(stack, [url])
        body = {"model": "m", "prompt": "hi", "max_tokens": 2, field: 7}
        headers = {"authorization": "Bearer key-a"}
        resp = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field
    assert fake.stats.requests == []
