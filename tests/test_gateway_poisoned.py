"""A request that stalls a live replica is failed once, never spread to the others.

Two fake replicas; the request lands on the first (least loaded, ties to the first). When the
first stops answering *this request* but still answers its readiness probe, the request is at
fault: a 504 (or an error event mid-stream), the replica stays in rotation, the second never
sees the request, and one `poisoned_request` line names tenant and request id. A replica that
does not answer its probe either is dead: ejected, and the request moves on as before.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    RoutingConfig,
    TenantAccess,
    hash_api_key,
)
from servefleet.bench.fake_upstream import FakeBehaviour, FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway

AUTH = {"authorization": "Bearer key-a"}
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Rig:
    def __init__(self, gateway: Gateway, base: str, fakes: list[FakeOpenAI]) -> None:
        self.gateway, self.base, self.fakes = gateway, base, fakes

    def state(self, index: int) -> str:
        replicas = self.gateway.deployment_stats()[0].replicas
        return str(replicas[index].state)


@pytest.fixture
def rig() -> Iterator[Rig]:
    with ExitStack() as stack:
        fakes = [FakeOpenAI(FakeBehaviour(completion_tokens=4)) for _ in range(2)]
        urls = [stack.enter_context(serve_in_thread(f)) for f in fakes]
        config = GatewayConfig(
            tenants=[GatewayTenant(name="a", api_keys=[ApiKeyRef(sha256=hash_api_key("key-a"))])],
            deployments=[
                GatewayDeployment(
                    name="d",
                    model="m",
                    tenants=[TenantAccess(name="a")],
                    upstream_timeout_seconds=0.5,
                )
            ],
            # Probed once at start: what the gateway learns later, it learns from requests.
            routing=RoutingConfig(probe_interval_seconds=3600),
            internal_port=None,
        )
        gateway = Gateway(config)
        gateway.set_replicas("d", urls, ready=urls)
        base = stack.enter_context(serve_in_thread(gateway))
        time.sleep(0.5)  # the start-up probe round (both ready) is over
        yield Rig(gateway, base, fakes)


def poisoned_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "poisoned_request" in r.getMessage()]


def test_a_request_that_stalls_a_live_replica_is_failed_once(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="servefleet.gateway")
    first, second = rig.fakes
    first.behaviour.hang = True  # this request never gets an answer; /ready still does
    r = httpx.post(rig.base + "/v1/chat/completions", headers=AUTH, json=CHAT, timeout=30)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "timeout"
    assert "not retried" in r.json()["error"]["message"]
    assert len(first.stats.requests) == 1 and not second.stats.requests  # not spread
    assert rig.state(0) == "ready"  # not ejected: it serves everyone else
    request_id = r.headers["x-request-id"]
    (line,) = poisoned_lines(caplog)
    assert "tenant=a" in line and f"request_id={request_id}" in line
    assert first.stats.headers[0]["x-request-id"] == request_id  # the engine can log it too
    first.behaviour.hang = False
    ok = httpx.post(rig.base + "/v1/chat/completions", headers=AUTH, json=CHAT, timeout=30)
    assert ok.status_code == 200 and len(first.stats.requests) == 2


def test_a_stream_that_stalls_a_live_replica_is_not_continued_elsewhere(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="servefleet.gateway")
    first, second = rig.fakes
    first.behaviour.token_delay_s = 30.0  # the status line, then silence
    events: list[Any] = []
    body = {**CHAT, "stream": True}
    with httpx.stream(
        "POST", rig.base + "/v1/chat/completions", headers=AUTH, json=body, timeout=30
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert events and "error" in events[-1]
    assert not second.stats.requests  # no continuation on the other replica
    assert rig.state(0) == "ready"
    assert len(poisoned_lines(caplog)) == 1


def test_a_dead_replica_is_still_ejected_and_the_request_moved(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="servefleet.gateway")
    first, second = rig.fakes
    first.behaviour.hang = True
    first.behaviour.ready = False  # its probe fails too: the replica, not the request
    r = httpx.post(rig.base + "/v1/chat/completions", headers=AUTH, json=CHAT, timeout=30)
    assert r.status_code == 200, r.text
    assert len(second.stats.requests) == 1
    assert rig.state(0) == "ejected"
    assert not poisoned_lines(caplog)


def test_a_4xx_answer_is_never_sent_to_another_replica(rig: Rig) -> None:
    first, second = rig.fakes
    first.behaviour.status = 400
    r = httpx.post(rig.base + "/v1/chat/completions", headers=AUTH, json=CHAT, timeout=30)
    assert r.status_code == 400
    assert len(first.stats.requests) == 1 and not second.stats.requests
    assert rig.state(0) == "ready"
