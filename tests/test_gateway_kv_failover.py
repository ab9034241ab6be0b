"""Failover without recompute, the gateway's half: a stream continued on another replica
names the live peers that may hold its prefix, so the new engine pulls the KV of the prompt
plus the delivered tokens instead of recomputing it. Never the dead replica, never the new
one itself, at most MAX_SOURCES, only for exact (servefleet) continuations of long prompts.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest

from servefleet.api.gateway_config import GatewayDeployment
from servefleet.api.kv_transfer import MAX_SOURCES
from servefleet.api.stream_resume import KV_TRANSFER_PARAMS, RESUME_TOKEN_IDS
from servefleet.bench.fake_upstream import FakeBehaviour, FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.kv_pull import failover_pull_params, failover_sources
from servefleet.gateway.pool import Lease
from servefleet.gateway.routing import ReplicaSet
from tests.support.gateway_rig import served_gateway
from tests.test_gateway_failover import TOKENS, Rig, stream, text_of, whole

ENDPOINTS = [f"http://10.0.0.{i}:8000" for i in range(7)]


def _replicas(count: int) -> ReplicaSet:
    replicas = ReplicaSet(cap=4)
    urls = ENDPOINTS[:count]
    replicas.set_endpoints(urls, 0.0, ready=urls)
    return replicas


def _lease(replicas: ReplicaSet, endpoint: str) -> Lease:
    return Lease(replicas.replicas[endpoint], 10, 0.0)


def test_sources_skip_the_dead_and_the_target_and_put_the_prior_holder_first() -> None:
    replicas = _replicas(4)
    dead, target = replicas.replicas[ENDPOINTS[0]], replicas.replicas[ENDPOINTS[1]]
    got = failover_sources(replicas, dead, target, [ENDPOINTS[3]])
    assert got == [ENDPOINTS[3], ENDPOINTS[2]]
    # a prior source that died since, or that is the target, is never named
    got = failover_sources(replicas, dead, target, [ENDPOINTS[0], ENDPOINTS[1]])
    assert got == [ENDPOINTS[2], ENDPOINTS[3]]


def test_sources_are_only_ready_replicas_and_capped() -> None:
    replicas = _replicas(7)
    replicas.eject(replicas.replicas[ENDPOINTS[2]], 0.0)
    dead, target = replicas.replicas[ENDPOINTS[0]], replicas.replicas[ENDPOINTS[1]]
    got = failover_sources(replicas, dead, target, ["http://10.9.9.9:8000"])
    assert len(got) == MAX_SOURCES
    assert ENDPOINTS[2] not in got and "http://10.9.9.9:8000" not in got
    assert got == ENDPOINTS[3 : 3 + MAX_SOURCES]


def _params(config: GatewayDeployment, body: dict[str, Any], tokens: int) -> dict[str, Any]:
    replicas = _replicas(3)
    leases = (_lease(replicas, ENDPOINTS[0]), _lease(replicas, ENDPOINTS[1]))
    return failover_pull_params(config, replicas, leases, body, tokens)


def test_a_long_exact_continuation_names_live_peers_with_the_deadline() -> None:
    config = GatewayDeployment.model_validate({"name": "d", "model": "m"})
    # the first request was sent away from ENDPOINTS[1], the replica it now lands on
    first = {KV_TRANSFER_PARAMS: {"kv_sources": [ENDPOINTS[1]], "deadline_s": 2.0}}
    body = _params(config, {**first, RESUME_TOKEN_IDS: [1, 2]}, 300)
    assert body[KV_TRANSFER_PARAMS] == {"kv_sources": [ENDPOINTS[2]], "deadline_s": 2.0}
    assert body[RESUME_TOKEN_IDS] == [1, 2]


@pytest.mark.parametrize(
    ("update", "tokens"),
    [({}, 255), ({"kv_pull_min_tokens": None}, 4096), ({"exact_continuation": False}, 4096)],
)
def test_short_prompts_and_text_continuations_pull_nothing(
    update: dict[str, Any], tokens: int
) -> None:
    config = GatewayDeployment.model_validate({"name": "d", "model": "m"}).model_copy(update=update)
    first = {KV_TRANSFER_PARAMS: {"kv_sources": [ENDPOINTS[0]], "deadline_s": 2.0}}
    assert KV_TRANSFER_PARAMS not in _params(config, dict(first), tokens)


def test_no_live_peer_sends_no_field() -> None:
    config = GatewayDeployment.model_validate({"name": "d", "model": "m"})
    replicas = _replicas(2)
    leases = (_lease(replicas, ENDPOINTS[0]), _lease(replicas, ENDPOINTS[1]))
    assert failover_pull_params(config, replicas, leases, {}, 4096) == {}


def test_a_broken_stream_is_continued_with_the_live_peers_as_sources() -> None:
    """Three fake replicas; the first two die mid-stream. Each continuation names the ready
    replicas other than the one it is sent to and the one that died (which is ejected)."""
    with ExitStack() as stack:
        fakes = [FakeOpenAI(FakeBehaviour(completion_tokens=TOKENS)) for _ in range(3)]
        urls = [stack.enter_context(serve_in_thread(f)) for f in fakes]
        gateway, base = served_gateway(stack, urls, kv_pull_min_tokens=1)
        rig = Rig(gateway, base, fakes)
        for fake in fakes[:-1]:
            fake.behaviour.die_after_chunks = 3
        body = {"model": "m", "max_tokens": TOKENS, "stream": True, "prompt": "hello there"}
        _, events = stream(rig, "/v1/completions", body)
        assert text_of(events) == whole()
        by_url = {url.rstrip("/"): fake for url, fake in zip(urls, fakes, strict=True)}
        sent = [(url, req) for url, fake in by_url.items() for req in fake.stats.requests]
        continued = [(url, req) for url, req in sent if req.get(RESUME_TOKEN_IDS)]
        assert len(continued) == 2
        (first_url,) = {url for url, req in sent if not req.get(RESUME_TOKEN_IDS)}
        ordered = sorted(continued, key=lambda p: len(p[1][RESUME_TOKEN_IDS]))
        (second_url, second), (_, third) = ordered
        # after the first death: the one live peer that is neither dead nor the target
        third_url = next(u for u in by_url if u not in (first_url, second_url))
        assert second[KV_TRANSFER_PARAMS] == {"kv_sources": [third_url], "deadline_s": 2.0}
        # after the second: both others are dead, so nothing is named (it recomputes)
        assert KV_TRANSFER_PARAMS not in third
