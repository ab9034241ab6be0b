"""A request whose replica fails before a byte while the only other one is busy waits for that
one's slot instead of failing with a 502 (the engine_kill fault scenario's second loss); a wait
past maxQueueWait is a truthful 503 with Retry-After."""

from __future__ import annotations

import threading
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
    TenantAccess,
    hash_api_key,
)
from servefleet.bench.fake_upstream import FakeBehaviour, FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway

AUTH = {"authorization": "Bearer key-a"}
BODY = {"model": "m", "prompt": "hi", "max_tokens": 4}
SLOW_TOKENS, TOKEN_DELAY_S = 30, 0.1  # the busy replica's stream: about 3 s


@pytest.fixture
def base(request: pytest.FixtureRequest) -> Iterator[str]:
    max_queue_wait: float = getattr(request, "param", 30.0)
    with ExitStack() as stack:
        fake = FakeOpenAI(FakeBehaviour(completion_tokens=SLOW_TOKENS, token_delay_s=TOKEN_DELAY_S))
        alive = stack.enter_context(serve_in_thread(fake))
        # Ready by its probe, but every completion fails before a byte (as a replica does
        # that died after its last probe).
        dead = stack.enter_context(serve_in_thread(FakeOpenAI(FakeBehaviour(status=500))))
        config = GatewayConfig(
            tenants=[GatewayTenant(name="a", api_keys=[ApiKeyRef(sha256=hash_api_key("key-a"))])],
            deployments=[
                GatewayDeployment.model_validate(
                    {
                        "name": "d",
                        "model": "m",
                        "tenants": [TenantAccess(name="a")],
                        "pool": {"perReplicaConcurrency": 1},
                        "admission": {"maxQueueWait": max_queue_wait},
                    }
                )
            ],
        )
        gateway = Gateway(config)
        gateway.set_replicas("d", [dead, alive], ready=[dead, alive])
        yield stack.enter_context(serve_in_thread(gateway))


def _occupy_the_live_replica(base: str) -> threading.Thread:
    """A long stream on the live replica (the failing one, if tried first, is ejected on the
    way and half-open again when this returns)."""
    body: dict[str, Any] = {**BODY, "max_tokens": SLOW_TOKENS, "stream": True}

    def run() -> None:
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=AUTH) as r:
            r.read()

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(1.5)  # past the dead replica's first ejection back-off (1 s)
    return thread


def test_a_request_on_a_failing_replica_waits_for_the_busy_one(base: str) -> None:
    busy = _occupy_the_live_replica(base)
    started = time.monotonic()
    r = httpx.post(base + "/v1/completions", json=BODY, headers=AUTH, timeout=30)
    waited = time.monotonic() - started
    busy.join()
    assert r.status_code == 200, r.text
    assert waited > 1.0  # served once the busy replica's stream (about 1.5 s more) ended
    assert r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("base", [0.5], indirect=True)
def test_a_wait_past_max_queue_wait_is_a_503_with_retry_after(base: str) -> None:
    busy = _occupy_the_live_replica(base)
    r = httpx.post(base + "/v1/completions", json=BODY, headers=AUTH, timeout=30)
    busy.join()
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
