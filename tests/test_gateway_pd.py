"""Disaggregated prefill/decode, the gateway's half, against fake replicas: what each engine
receives for each protocol (servefleet, vLLM's proxy flow, SGLang's bootstrap room), that a
short prompt stays colocated, that the client sees the decode replica's answer, and that a
tenant can never send `kv_transfer_params` itself."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest

from servefleet.api.gateway_config import PrefillRouting
from servefleet.api.gateway_stats import DeploymentStats
from servefleet.api.kv_events import ROUTE_DECISIONS_METRIC
from servefleet.bench.fake_upstream import FakeBehaviour, FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway
from servefleet.gateway.pd import VLLM_PREFILL_PARAMS, with_prefill
from tests.support.gateway_rig import served_gateway

AUTH = {"authorization": "Bearer key-a"}
LONG = "the tide comes in and the tide goes out " * 40  # ~400 estimated tokens
SHORT = "hi"
NIXL = {"do_remote_prefill": True, "remote_engine_id": "p-0", "remote_block_ids": [3, 4]}


class Rig:
    def __init__(self, gateway: Gateway, base: str, p: FakeOpenAI, d: FakeOpenAI) -> None:
        self.gateway, self.base, self.p, self.d = gateway, base, p, d

    def pd_decisions(self) -> float:
        labels = {"deployment": "d", "model": "m", "decision": "pd"}
        return self.gateway.metrics.registry.get_sample_value(ROUTE_DECISIONS_METRIC, labels) or 0


def rig(stack: ExitStack, protocol: str, p_behaviour: FakeBehaviour | None = None) -> Rig:
    p = FakeOpenAI(p_behaviour or FakeBehaviour(completion_tokens=4))
    d = FakeOpenAI(FakeBehaviour(completion_tokens=4))
    p_url, d_url = stack.enter_context(serve_in_thread(p)), stack.enter_context(serve_in_thread(d))
    prefill = PrefillRouting(endpoints=[p_url], threshold=100, protocol=protocol)  # type: ignore[arg-type]
    gateway, base = served_gateway(stack, [d_url], prefill=prefill, kv_pull_min_tokens=None)
    pool = gateway.pools["d"]
    assert pool.prefill is not None and pool.prefill.name == "d-prefill"
    deadline = time.monotonic() + 10  # the prober finds the prefill replica ready
    while not pool.prefill.replicas.ready_count(pool.now()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.prefill.replicas.ready_count(pool.now()) == 1
    return Rig(gateway, base, p, d)


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def complete(r: Rig, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, **extra}
    return httpx.post(r.base + "/v1/completions", headers=AUTH, json=body, timeout=30)


def stream(r: Rig, prompt: str) -> list[dict[str, Any]]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": True}
    events = []
    with httpx.stream("POST", r.base + "/v1/completions", headers=AUTH, json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events


def test_servefleet_decode_replica_is_told_the_prefill_replica(stack: ExitStack) -> None:
    r = rig(stack, "servefleet")
    assert complete(r, LONG).status_code == 200
    (sent,) = r.d.stats.requests
    params = sent["kv_transfer_params"]
    assert params["remote_prefill"] == r.gateway.pools["d"].prefill.replicas.stats()[0].endpoint  # type: ignore[union-attr]
    assert params["prefill_threshold"] == 100 and 0 < params["deadline_s"] <= 60
    assert r.p.stats.requests == []  # the decode engine asks the prefill engine itself
    assert r.pd_decisions() == 1
    assert complete(r, SHORT).status_code == 200  # under the threshold: colocated
    assert "kv_transfer_params" not in r.d.stats.requests[-1]
    assert r.pd_decisions() == 1
    prefill = r.gateway.pools["d"].prefill
    assert prefill is not None and prefill.replicas.outstanding() == 0  # its load went back


def test_vllm_prefill_first_then_decode_with_its_params(stack: ExitStack) -> None:
    r = rig(stack, "vllm", FakeBehaviour(completion_tokens=4, kv_transfer_params=NIXL))
    events = stream(r, LONG)
    assert events and events[0]["choices"][0]["text"] == " tok0"  # the decode replica streams
    (to_p,) = r.p.stats.requests
    assert to_p["kv_transfer_params"] == VLLM_PREFILL_PARAMS
    assert to_p["max_tokens"] == 1 and to_p["stream"] is False
    assert "stream_options" not in to_p and to_p["prompt"] == LONG
    (to_d,) = r.d.stats.requests
    assert to_d["kv_transfer_params"] == NIXL
    assert to_d["max_tokens"] == 4 and to_d["stream"] is True and to_d["prompt"] == LONG


def test_vllm_failed_prefill_means_the_decode_replica_computes(stack: ExitStack) -> None:
    r = rig(stack, "vllm", FakeBehaviour(status=500))
    assert complete(r, LONG).status_code == 200
    assert len(r.p.stats.requests) == 1
    (to_d,) = r.d.stats.requests
    assert "kv_transfer_params" not in to_d


def test_sglang_both_get_the_same_bootstrap_room(stack: ExitStack) -> None:
    r = rig(stack, "sglang")
    assert complete(r, LONG).status_code == 200
    deadline = time.monotonic() + 5
    while not r.p.stats.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    (to_p,), (to_d,) = r.p.stats.requests, r.d.stats.requests
    assert to_p == to_d
    assert to_d["bootstrap_host"] == "127.0.0.1" and to_d["bootstrap_port"] == 8998
    assert 0 <= to_d["bootstrap_room"] < 2**63 and to_d["prompt"] == LONG
    assert "kv_transfer_params" not in to_d
    complete(r, LONG)
    assert r.d.stats.requests[1]["bootstrap_room"] != to_d["bootstrap_room"]


def test_a_tenant_cannot_send_kv_transfer_params(stack: ExitStack) -> None:
    r = rig(stack, "servefleet")
    params = {"remote_prefill": "http://127.0.0.1:9"}
    reply = complete(r, LONG, kv_transfer_params=params)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "kv_transfer_params"
    assert r.d.stats.requests == [] and r.p.stats.requests == []


def test_prefill_pools_are_probed_and_watched_with_their_pool() -> None:
    with ExitStack() as s:
        r = rig(s, "servefleet")
        names = [p.name for p in with_prefill(r.gateway.pools.values())]
        assert names == ["d", "d-prefill"]


def both_placed(stats: DeploymentStats) -> bool:
    """One prompt on the prefill replica and one that found it full."""
    running, queued = stats.prefill_prompt_tokens_running, stats.prefill_prompt_tokens_queued
    return bool(running and queued)


def test_prefill_pool_demand_is_reported_for_its_autoscaler(stack: ExitStack) -> None:
    """The prefill pool's signal in the stats the autoscaler reads: prompt tokens on its
    replicas, and those that found no prefill replica with room (prefilled on a decode
    replica instead); both back to zero once the requests end."""
    from concurrent.futures import ThreadPoolExecutor

    from servefleet.api.llmdeployment import PoolSpec

    p = FakeOpenAI(FakeBehaviour(completion_tokens=4))
    d = FakeOpenAI(FakeBehaviour(completion_tokens=4, first_token_delay_s=1.5))
    p_url, d_url = stack.enter_context(serve_in_thread(p)), stack.enter_context(serve_in_thread(d))
    one_slot = PoolSpec(per_replica_concurrency=1)
    prefill = PrefillRouting(endpoints=[p_url], threshold=100, pool=one_slot)
    gateway, base = served_gateway(stack, [d_url], prefill=prefill, kv_pull_min_tokens=None)
    pool = gateway.pools["d"]
    assert pool.prefill is not None
    deadline = time.monotonic() + 10
    while not pool.prefill.replicas.ready_count(pool.now()) and time.monotonic() < deadline:
        time.sleep(0.05)
    r = Rig(gateway, base, p, d)
    assert pool.stats().prefill_prompt_tokens == 0
    with ThreadPoolExecutor(2) as workers:
        answers = [workers.submit(complete, r, LONG) for _ in range(2)]
        # Both requests are in flight before the second has been placed (or overflowed), so
        # wait for the placement itself; the decode replica holds both for 1.5 s.
        deadline = time.monotonic() + 5
        stats = pool.stats()
        while not both_placed(stats) and time.monotonic() < deadline:
            time.sleep(0.02)
            stats = pool.stats()
        assert [a.result().status_code for a in answers] == [200, 200]
    running, queued = stats.prefill_prompt_tokens_running, stats.prefill_prompt_tokens_queued
    assert running is not None and queued is not None
    assert running >= 100 and queued >= 100  # one prompt on the prefill replica, one overflowed
    assert len(stats.prefill) == 1
    after = pool.stats()
    assert (after.prefill_prompt_tokens_running, after.prefill_prompt_tokens_queued) == (0, 0)
    assert r.pd_decisions() == 1
    exposition = generate_latest(gateway.metrics.registry).decode()
    assert exposition.count(f"# TYPE {ROUTE_DECISIONS_METRIC} counter") == 1  # one family
