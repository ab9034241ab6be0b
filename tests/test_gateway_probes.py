"""The readiness probe loop, and priority push-out and latency percentiles over HTTP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
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
from servefleet.api.gateway_stats import DeploymentStats
from servefleet.api.llmdeployment import AdmissionSpec, PoolSpec
from servefleet.bench.fake_upstream import FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway

BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def tenant(name: str) -> GatewayTenant:
    return GatewayTenant(name=name, api_keys=[ApiKeyRef(sha256=hash_api_key(f"key-{name}"))])


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer key-{name}"}


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def states(gateway: Gateway) -> dict[str, str]:
    return {r.endpoint: r.state for r in gateway.deployment_stats()[0].replicas}


@pytest.fixture
def probed() -> Iterator[tuple[Gateway, str, list[FakeOpenAI], list[str]]]:
    """A gateway probing two static replicas every 50 ms; the first is still loading."""
    with ExitStack() as stack:
        fakes = [FakeOpenAI(), FakeOpenAI()]
        fakes[0].behaviour.ready = False
        urls = [stack.enter_context(serve_in_thread(f)) for f in fakes]
        config = GatewayConfig(
            tenants=[tenant("a")],
            deployments=[
                GatewayDeployment(
                    name="d",
                    model="m",
                    endpoints=urls,
                    tenants=[TenantAccess(name="a")],
                    cold_start_seconds=300.0,
                )
            ],
            routing=RoutingConfig(probe_interval_seconds=0.05),
        )
        gateway = Gateway(config)
        base = stack.enter_context(serve_in_thread(gateway))
        yield gateway, base, fakes, urls


def test_probes_bring_replicas_in_measure_cold_start_and_take_draining_ones_out(
    probed: tuple[Gateway, str, list[FakeOpenAI], list[str]],
) -> None:
    gateway, base, fakes, urls = probed
    loading, up = urls
    wait_until(lambda: states(gateway) == {loading: "starting", up: "ready"})
    assert gateway.deployment_stats()[0].cold_start_seconds == 300.0  # nothing measured yet
    fakes[0].behaviour.ready = True  # finished loading
    wait_until(lambda: states(gateway)[loading] == "ready")
    # Seen loading, then ready: a measured cold start replaces the 300 s assumption.
    assert gateway.deployment_stats()[0].cold_start_seconds < 30.0
    fakes[1].behaviour.ready = False  # draining (SIGTERM): readiness fails first
    wait_until(lambda: states(gateway)[up] == "draining")
    for _ in range(3):
        assert httpx.post(base + "/v1/chat/completions", json=BODY, headers=auth("a")).is_success
    assert len(fakes[1].stats.requests) == 0 and len(fakes[0].stats.requests) == 3
    fakes[1].behaviour.ready = True  # a pod that stayed (e.g. the drain was cancelled)
    wait_until(lambda: states(gateway)[up] == "ready")


def test_a_probe_that_cannot_connect_takes_a_ready_replica_out() -> None:
    fake = FakeOpenAI()
    with ExitStack() as stack:
        url = stack.enter_context(serve_in_thread(fake))
        gone = "http://127.0.0.1:9"  # nothing listens on the discard port
        config = GatewayConfig(
            tenants=[tenant("a")],
            deployments=[GatewayDeployment(name="d", model="m", tenants=[TenantAccess(name="a")])],
            routing=RoutingConfig(probe_interval_seconds=0.05),
        )
        gateway = Gateway(config)
        gateway.set_replicas("d", [url, gone], ready=[url, gone])
        stack.enter_context(serve_in_thread(gateway))
        wait_until(lambda: states(gateway) == {url: "ready", gone: "draining"})


def test_probes_ask_the_engine_adapters_ready_path() -> None:
    """vLLM has no /ready (its /health answers once warm): the configured path is the one asked."""
    fakes = [FakeOpenAI(), FakeOpenAI()]
    for fake in fakes:
        fake.behaviour.ready = False  # /ready answers 503, /health 200
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(f)) for f in fakes]
        config = GatewayConfig(
            tenants=[tenant("a")],
            deployments=[
                GatewayDeployment(name=name, model=name, endpoints=[url], ready_path=path)
                for name, url, path in (("ours", urls[0], "/ready"), ("vllm", urls[1], "/health"))
            ],
            routing=RoutingConfig(probe_interval_seconds=0.05),
        )
        gateway = Gateway(config)
        stack.enter_context(serve_in_thread(gateway))
        wait_until(
            lambda: (
                [s.replicas[0].state for s in gateway.deployment_stats()] == ["starting", "ready"]
            )
        )


def test_an_interactive_request_pushes_a_queued_batch_one_out_over_http() -> None:
    fake = FakeOpenAI()
    fake.behaviour.first_token_delay_s = 0.6  # the only slot stays busy while we line up
    with ExitStack() as stack:
        url = stack.enter_context(serve_in_thread(fake))
        config = GatewayConfig(
            tenants=[tenant("live"), tenant("nightly")],
            deployments=[
                GatewayDeployment(
                    name="d",
                    model="m",
                    endpoints=[url],
                    pool=PoolSpec(per_replica_concurrency=1),
                    admission=AdmissionSpec(max_queue_depth=1, max_queue_wait=30),
                    tenants=[
                        TenantAccess(name="live", traffic_class="interactive"),
                        TenantAccess(name="nightly", traffic_class="batch"),
                    ],
                    service_seconds=0.5,
                )
            ],
        )
        gateway = Gateway(config)
        gateway.set_replicas("d", [url], ready=[url])
        base = stack.enter_context(serve_in_thread(gateway))

        def stats() -> DeploymentStats:
            return gateway.deployment_stats()[0]

        async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                post = client.post
                busy = asyncio.create_task(
                    post("/v1/chat/completions", json=BODY, headers=auth("live"))
                )
                while stats().in_flight < 1:
                    await asyncio.sleep(0.01)
                batch = asyncio.create_task(
                    post("/v1/chat/completions", json=BODY, headers=auth("nightly"))
                )
                while stats().queue_depth_batch < 1:
                    await asyncio.sleep(0.01)
                interactive = await post("/v1/chat/completions", json=BODY, headers=auth("live"))
                return await busy, await batch, interactive

        busy, batch, interactive = asyncio.run(scenario())
    assert busy.status_code == 200 and interactive.status_code == 200
    assert batch.status_code == 503
    assert "pushed out" in batch.json()["error"]["message"]
    assert int(batch.headers["retry-after"]) >= 1
    # The percentiles the autoscaler reads: the interactive one waited ~ one service time.
    reported = stats()
    queue_wait, ttft = reported.queue_wait_p90_seconds, reported.ttft_p90_seconds
    assert queue_wait is not None and ttft is not None
    assert queue_wait > 0.1
    assert ttft >= queue_wait
