"""The gateway end to end over HTTP, against in-test OpenAI-compatible upstreams."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from typing import Any

import httpx
import openai
import pytest

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    SecretValueRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.llmdeployment import PoolSpec, SpilloverSpec, TenantLimits
from servefleet.bench.fake_upstream import FakeBehaviour, FakeOpenAI
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway

MESSAGES: list[Any] = [{"role": "user", "content": "hello there"}]
INTERNAL = {"authorization": "Bearer internal-key"}
CHAT: dict[str, Any] = {"model": "m", "messages": MESSAGES, "max_tokens": 8}


def tenant(name: str, **limits: Any) -> GatewayTenant:
    return GatewayTenant(
        name=name,
        api_keys=[ApiKeyRef(sha256=hash_api_key(f"key-{name}"))],
        limits=TenantLimits(**limits),
    )


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer key-{name}"}


class Rig:
    def __init__(self, gateway: Gateway, base: str, internal: str, fakes: list[FakeOpenAI]) -> None:
        self.gateway, self.base, self.internal, self.fakes = gateway, base, internal, fakes


@pytest.fixture
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    """Gateway + N fake replicas; parametrise with a dict of options via indirect."""
    opts: dict[str, Any] = getattr(request, "param", {})
    with ExitStack() as stack:
        fakes = [FakeOpenAI(FakeBehaviour()) for _ in range(opts.get("replicas", 1))]
        urls = [stack.enter_context(serve_in_thread(f)) for f in fakes]
        spill_kw: dict[str, Any] = {}
        if "spill" in opts:
            hosted = FakeOpenAI(FakeBehaviour(require_key="hosted-key"))
            fakes.append(hosted)
            hosted_url = stack.enter_context(serve_in_thread(hosted))
            spill_kw = {
                "spillover": SpilloverSpec.model_validate(
                    {
                        "enabled": True,
                        "baseURL": hosted_url + "/v1",
                        "model": "hosted-m",
                        "apiKeySecretRef": {"name": "s", "key": "k"},
                        **opts["spill"],
                    }
                ),
                "spillover_api_key": SecretValueRef(env="HOSTED_KEY"),
            }
        config = GatewayConfig(
            tenants=[tenant("a", **opts.get("limits", {})), tenant("b")],
            deployments=[
                GatewayDeployment(
                    name="d",
                    model="m",
                    tenants=[TenantAccess(name="a"), TenantAccess(name="b")],
                    upstream_timeout_seconds=opts.get("timeout", 30.0),
                    cold_start_seconds=60.0,  # longer than maxQueueWait (30 s)
                    pool=PoolSpec(per_replica_concurrency=opts.get("concurrency", 8)),
                    **spill_kw,
                ),
                GatewayDeployment(
                    name="other",
                    model="secret-model",
                    tenants=[TenantAccess(name="b")],
                    allowed_replica_networks=["127.0.0.0/8"],
                ),
            ],
            internal_api_key=SecretValueRef(value="internal-key"),
        )
        gateway = Gateway(config, environ={"HOSTED_KEY": "hosted-key"})
        if not opts.get("no_replicas"):
            gateway.set_replicas("d", urls, ready=urls)
        base = stack.enter_context(serve_in_thread(gateway))
        internal = stack.enter_context(serve_in_thread(gateway.internal, lifespan="off"))
        yield Rig(gateway, base, internal, fakes)


def test_auth_models_and_not_found(rig: Rig) -> None:
    assert httpx.post(rig.base + "/v1/chat/completions", json=CHAT).status_code == 401
    models = httpx.get(rig.base + "/v1/models", headers=auth("a")).json()
    assert [m["id"] for m in models["data"]] == ["m"]
    # Tenant a may not use secret-model: the same 404 as a model that does not exist.
    hidden = httpx.post(
        rig.base + "/v1/chat/completions", headers=auth("a"), json={**CHAT, "model": "secret-model"}
    )
    missing = httpx.post(
        rig.base + "/v1/chat/completions", headers=auth("a"), json={**CHAT, "model": "nope"}
    )
    assert hidden.status_code == missing.status_code == 404
    assert hidden.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(
        rig.base + "/v1/chat/completions", headers=auth("a"), json={"model": "m", "messages": []}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("rig", [{"limits": {"tokens_per_minute": 5 * 60}}], indirect=True)
def test_burst_of_20_gets_5_admitted_and_15_429s_with_openai_headers(rig: Rig) -> None:
    # Each request reserves its prompt estimate (8) + max_tokens 50 = 58 -> 5 fit in 300.
    body = {**CHAT, "max_tokens": 50}
    # Slow answers: no request settles (and refunds) before all 20 have been decided.
    rig.fakes[0].behaviour.first_token_delay_s = 1.0

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(
                *(
                    client.post(rig.base + "/v1/chat/completions", headers=auth("a"), json=body)
                    for _ in range(20)
                )
            )

    responses = asyncio.run(fire())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) == 5 and codes.count(429) == 15
    limited = next(r for r in responses if r.status_code == 429)
    assert int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    for r in responses:
        assert r.headers["x-ratelimit-limit-tokens"] == "300"
        assert "x-ratelimit-remaining-tokens" in r.headers
        assert "x-ratelimit-reset-tokens" in r.headers


def test_openai_client_sync_async_streaming_and_not(rig: Rig) -> None:
    client = openai.OpenAI(base_url=rig.base + "/v1", api_key="key-a")
    reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    assert reply.choices[0].message.content and reply.usage is not None
    stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, stream=True)
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks)  # injected usage chunk is hidden
    with_usage = list(
        client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert with_usage[-1].usage is not None
    text = client.completions.create(model="m", prompt="once upon", max_tokens=4)
    assert text.choices[0].text

    async def run_async() -> str:
        aclient = openai.AsyncOpenAI(base_url=rig.base + "/v1", api_key="key-a")
        parts = []
        async for chunk in await aclient.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=4, stream=True
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        plain = await aclient.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
        await aclient.close()
        return "".join(parts) + str(plain.choices[0].message.content)

    assert "tok" in asyncio.run(run_async())
    raw = httpx.post(rig.base + "/v1/chat/completions", headers=auth("a"), json=CHAT)
    assert raw.headers["x-servefleet-route"] == "pool"


@pytest.mark.parametrize("rig", [{"limits": {"max_concurrent_requests": 1}}], indirect=True)
def test_openai_client_backs_off_on_our_429_and_then_succeeds(rig: Rig) -> None:
    rig.fakes[0].behaviour.token_delay_s = 0.1  # the first request holds the only slot ~0.8 s

    async def both() -> list[Any]:
        aclient = openai.AsyncOpenAI(base_url=rig.base + "/v1", api_key="key-a", max_retries=3)
        first = asyncio.create_task(
            aclient.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8)
        )
        await asyncio.sleep(0.2)
        second = await aclient.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES, max_tokens=8
        )
        return [await first, second]

    first, second = asyncio.run(both())
    assert first.choices[0].message.content
    assert second.http_response.status_code == 200
    arrivals = rig.fakes[0].stats.arrivals
    assert len(arrivals) == 2  # the refused attempt never reached the replica
    # The client waited for our Retry-After (1 s) before trying again.
    assert arrivals[1] - arrivals[0] >= 1.0


@pytest.mark.parametrize("rig", [{"no_replicas": True, "spill": {}}], indirect=True)
def test_spill_over_when_no_replica_is_ready(rig: Rig) -> None:
    hosted = rig.fakes[-1]
    response = httpx.post(rig.base + "/v1/chat/completions", headers=auth("a"), json=CHAT)
    assert response.status_code == 200
    assert response.headers["x-servefleet-route"] == "spillover"
    assert hosted.stats.requests[-1]["model"] == "hosted-m"
    with httpx.stream(
        "POST", rig.base + "/v1/chat/completions", headers=auth("a"), json={**CHAT, "stream": True}
    ) as stream:
        assert stream.headers["x-servefleet-route"] == "spillover"
        assert b"[DONE]" in stream.read()
    metrics = httpx.get(rig.internal + "/metrics", headers=INTERNAL).text
    assert 'outcome="spilled",tenant="a"} 2.0' in metrics


@pytest.mark.parametrize(
    "rig", [{"no_replicas": True, "spill": {"maxRequestsPerMinute": 1}}], indirect=True
)
def test_spill_over_rate_cap_sheds_with_retry_after(rig: Rig) -> None:
    first = httpx.post(rig.base + "/v1/chat/completions", headers=auth("a"), json=CHAT)
    second = httpx.post(rig.base + "/v1/chat/completions", headers=auth("a"), json=CHAT)
    assert first.status_code == 200
    # No replica, no spill budget, a 60 s cold start ahead: shed now, retry after the prediction.
    assert second.status_code == 503 and int(second.headers["retry-after"]) == 60
    assert second.json()["error"]["type"] == "server_overloaded"


@pytest.mark.parametrize("rig", [{"replicas": 2}], indirect=True)
def test_failed_replica_is_retried_elsewhere_and_ejected(rig: Rig) -> None:
    bad, _good = rig.fakes
    bad.behaviour.status = 500
    for _ in range(4):
        r = httpx.post(rig.base + "/v1/chat/completions", headers=auth("a"), json=CHAT)
        assert r.status_code == 200
    assert len(bad.stats.requests) == 1  # ejected after its first failure
    states = {r.endpoint: r.state for r in rig.gateway.deployment_stats()[0].replicas}
    assert "ejected" in states.values()


@pytest.mark.parametrize("rig", [{"replicas": 2}], indirect=True)
def test_draining_replica_gets_no_new_requests(rig: Rig) -> None:
    draining, other = rig.fakes
    draining.behaviour.status = 503
    for _ in range(4):
        r = httpx.post(rig.base + "/v1/chat/completions", headers=auth("a"), json=CHAT)
        assert r.status_code == 200
    assert len(draining.stats.requests) <= 1
    assert len(other.stats.requests) >= 4


@pytest.mark.parametrize("rig", [{"timeout": 0.5}], indirect=True)
def test_hanging_upstream_is_cut_with_an_openai_error(rig: Rig) -> None:
    rig.fakes[0].behaviour.hang = True
    started = time.monotonic()
    r = httpx.post(rig.base + "/v1/chat/completions", headers=auth("a"), json=CHAT, timeout=30)
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "upstream_error"
    assert time.monotonic() - started < 25  # cut by the gateway, not by the client


def test_a_client_leaving_a_whole_answer_aborts_the_upstream(rig: Rig) -> None:
    """A non-streaming client that gives up must not leave the engine generating for nobody."""
    fake = rig.fakes[0]
    fake.behaviour.hang = True
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(rig.base + "/v1/chat/completions", headers=auth("a"), json=CHAT, timeout=1.0)
    deadline = time.monotonic() + 10  # far below the 30 s upstream timeout of this rig
    while fake.stats.disconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake.stats.disconnects == 1
    fake.behaviour.hang = False
    assert rig.gateway.pools["d"].in_flight == 0  # the lease came back


@pytest.mark.parametrize("rig", [{"concurrency": 1}], indirect=True)
def test_a_client_leaving_the_queue_gives_its_place_back(rig: Rig) -> None:
    fake, pool = rig.fakes[0], rig.gateway.pools["d"]
    fake.behaviour.hang = True
    with ExitStack() as stack:
        holder = stack.enter_context(httpx.Client(timeout=30))
        stack.callback(fake.behaviour.__setattr__, "hang", False)
        held = threading.Thread(
            target=lambda: _post_quietly(holder, rig.base, timeout=3.0), daemon=True
        )
        held.start()
        deadline = time.monotonic() + 10
        while pool.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.in_flight == 1  # the only slot is taken
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(rig.base + "/v1/chat/completions", headers=auth("a"), json=CHAT, timeout=1)
        deadline = time.monotonic() + 5
        while len(pool.queue) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pool.queue) == 0  # gone from the queue at once, not after maxQueueWait
        held.join(timeout=10)
    assert len(fake.stats.requests) == 1  # the one that left never reached the replica


def _post_quietly(client: httpx.Client, base: str, *, timeout: float) -> None:
    with suppress(httpx.TimeoutException):
        client.post(base + "/v1/chat/completions", headers=auth("a"), json=CHAT, timeout=timeout)


def test_internal_api_reports_and_updates_replicas(rig: Rig) -> None:
    stats = httpx.get(rig.internal + "/internal/deployments", headers=INTERNAL).json()
    assert {s["name"] for s in stats} == {"d", "other"}
    assert {"queue_depth", "in_flight", "service_rate"} <= set(stats[0])
    r = httpx.post(
        rig.internal + "/internal/deployments/other/replicas",
        json={"endpoints": ["http://127.0.0.1:9"]},
        headers=INTERNAL,
    )
    assert r.status_code == 200 and r.json()["replicas"][0]["state"] == "starting"
    assert (
        httpx.post(
            rig.internal + "/internal/deployments/x/replicas",
            json={"endpoints": []},
            headers=INTERNAL,
        ).status_code
        == 404
    )


def test_every_lease_is_given_back_after_a_burst_that_queues(rig: Rig) -> None:
    # More requests than the one replica's slots: some are served at once, the rest queue and
    # are handed a slot as others end; afterwards nothing may still count as busy.
    rig.fakes[0].behaviour.token_delay_s = 0.01

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=rig.base, timeout=30) as client:
            calls = [
                client.post(
                    "/v1/chat/completions", headers=auth("a"), json={**CHAT, "stream": i % 2 == 0}
                )
                for i in range(24)
            ]
            return [r.status_code for r in await asyncio.gather(*calls)]

    codes = asyncio.run(burst())
    assert codes == [200] * 24
    stats = rig.gateway.deployment_stats()[0]
    assert stats.queue_depth == 0 and stats.in_flight == 0
    assert [r.outstanding for r in stats.replicas] == [0]
    assert stats.queue_wait_p90_seconds is not None and stats.queue_wait_p90_seconds > 0


def test_a_client_leaving_a_stream_is_client_closed_not_an_upstream_error(rig: Rig) -> None:
    """The SLO alerts count upstream errors: a client that goes away must not burn the budget."""
    fake = rig.fakes[0]
    fake.behaviour.completion_tokens, fake.behaviour.token_delay_s = 200, 0.02
    body = {**CHAT, "stream": True}
    with httpx.stream("POST", rig.base + "/v1/chat/completions", headers=auth("a"), json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one event received, then the client leaves
    deadline = time.monotonic() + 10
    metrics = ""
    while 'outcome="client_closed",tenant="a"} 1.0' not in metrics:
        assert time.monotonic() < deadline, metrics
        time.sleep(0.05)
        metrics = httpx.get(rig.internal + "/metrics", headers=INTERNAL).text
    assert 'outcome="upstream_error",tenant="a"} 0.0' in metrics


def test_a_client_leaving_before_a_whole_answer_is_counted_once(rig: Rig) -> None:
    """A client that gives up on a whole answer (or while queued) is a request too: counted
    once, as client_closed, like a stream it leaves (it used to be counted nowhere)."""
    rig.fakes[0].behaviour.hang = True
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(rig.base + "/v1/chat/completions", headers=auth("a"), json=CHAT, timeout=0.5)
    deadline = time.monotonic() + 10
    metrics = ""
    while 'outcome="client_closed",tenant="a"} 1.0' not in metrics:
        assert time.monotonic() < deadline, metrics
        time.sleep(0.05)
        metrics = httpx.get(rig.internal + "/metrics", headers=INTERNAL).text
    assert 'outcome="upstream_error",tenant="a"} 0.0' in metrics
