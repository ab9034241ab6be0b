"""The gateway in front of real engine processes (SmolLM2), with a real Redis, as processes.

Three `servefleet engine` replicas (two in the pool from the start, a third added later through
the internal API), two `servefleet gateway` processes sharing one `redis-server`, and the
official `openai` client. Run it on its own:
    uv run pytest e2e/test_gateway_engine.py -s
The engines share the machine's cores, so every request asks for a handful of tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from procs import free_port as _free_port
from procs import servefleet_command as _servefleet

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    RedisConfig,
    RoutingConfig,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.llmdeployment import AdmissionSpec, PoolSpec, TenantLimits

MODEL = "smollm2-135m-instruct"
DEPLOYMENT = "smollm2"
INTERNAL_KEY = "sk-internal-gateway-e2e"
INTERNAL = {"authorization": f"Bearer {INTERNAL_KEY}"}  # the gateways' internal port needs it
READY_TIMEOUT_S = float(os.environ.get("SERVEFLEET_E2E_READY_S", "240"))
# A token-id prompt has an exact size without a tokenizer: 10 ids + 4 completion tokens.
ID_PROMPT = list(range(1000, 1010))
BURST_REQUEST_TOKENS = len(ID_PROMPT) + 4
ENGINE_ARGS = [
    "--max-num-seqs",
    "4",
    "--threads",
    "1",
    "--kv-cache-memory",
    "128MiB",
    "--drain-timeout",
    "90",
]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    internal_url: str = ""  # a gateway's /metrics and /internal/* (not on its tenant port)

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Fleet:
    engines: list[Child]
    gateways: list[Child]
    redis: subprocess.Popen[bytes]
    spare: Child  # started with the others, joins the pool later
    children: list[Child] = field(default_factory=list)

    def client(self, tenant: str, gateway: int = 0, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.gateways[gateway].url + "/v1", api_key=f"key-{tenant}", **kw
        )

    def aclient(self, tenant: str, gateway: int = 0, **kw: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.gateways[gateway].url + "/v1", api_key=f"key-{tenant}", **kw
        )

    def stats(self, gateway: int = 0) -> dict[str, Any]:
        internal = self.gateways[gateway].internal_url
        body = httpx.get(internal + "/internal/deployments", headers=INTERNAL, timeout=10).json()
        return next(d for d in body if d["name"] == DEPLOYMENT)

    def replica(self, endpoint: str, gateway: int = 0) -> dict[str, Any]:
        return next(r for r in self.stats(gateway)["replicas"] if r["endpoint"] == endpoint)


def engine_served(url: str) -> int:
    """Requests an engine completed, from its own vLLM-named metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(r"^vllm:e2e_request_latency_seconds_count\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert found, "engine metrics lack vllm:e2e_request_latency_seconds_count"
    return int(float(found.group(1)))


def gateway_counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers=INTERNAL, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def _wait_ready(child: Child, deadline: float) -> None:
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            pytest.fail(f"{child.name} exited with {child.proc.returncode}:\n{child.tail()}")
        try:
            if httpx.get(child.url + "/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{child.name} not ready after {READY_TIMEOUT_S:g}s:\n{child.tail()}")


def _start(name: str, argv: list[str], url: str, logs: Path) -> Child:
    log = logs / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    return Child(name, proc, url, log)


def _gateway_config(endpoints: list[str], redis_url: str) -> GatewayConfig:
    def tenant(name: str, **limits: Any) -> GatewayTenant:
        return GatewayTenant(
            name=name,
            api_keys=[ApiKeyRef(sha256=hash_api_key(f"key-{name}"))],
            limits=TenantLimits(**limits),
        )

    return GatewayConfig(
        host="127.0.0.1",
        redis=RedisConfig(url=redis_url, gateway_replicas=2),
        tenants=[
            tenant("acme"),
            tenant("counted", tokens_per_minute=100_000),
            tenant("bursty", tokens_per_minute=5 * BURST_REQUEST_TOKENS),
        ],
        deployments=[
            GatewayDeployment(
                name=DEPLOYMENT,
                model=MODEL,
                endpoints=endpoints,
                tokenizer=MODEL,
                pool=PoolSpec(per_replica_concurrency=4),
                admission=AdmissionSpec(max_queue_depth=64, max_queue_wait=120),
                tenants=[TenantAccess(name=t) for t in ("acme", "counted", "bursty")],
                upstream_timeout_seconds=180,
            )
        ],
        # Probes only at start: the tests below must see the gateway learn of a draining or
        # dead replica from the requests themselves (a probe could get there first).
        routing=RoutingConfig(probe_interval_seconds=3600),
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        pytest.fail("redis-server is not installed (Debian: apt-get install -y redis-server)")
    logs = tmp_path_factory.mktemp("gateway-e2e")
    children: list[Child] = []
    redis_port = _free_port()
    redis = subprocess.Popen(
        [redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for i in range(3):
            port = _free_port()
            argv = [*_servefleet(), "engine", "--model", MODEL, "--host", "127.0.0.1"]
            children.append(
                _start(
                    f"engine-{i}",
                    [*argv, "--port", str(port), *ENGINE_ARGS],
                    f"http://127.0.0.1:{port}",
                    logs,
                )
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        for child in children:
            _wait_ready(child, deadline)
        engines, spare = children[:2], children[2]
        config_file = logs / "gateway.yaml"
        config = _gateway_config([e.url for e in engines], f"redis://127.0.0.1:{redis_port}/0")
        config_file.write_text(config.model_dump_json(by_alias=True, exclude_none=True))
        key_file = logs / "internal-key"
        key_file.write_text(INTERNAL_KEY)
        gateways = []
        for i in range(2):
            port, internal = _free_port(), _free_port()
            argv = [*_servefleet(), "gateway", "--config", str(config_file), "--port", str(port)]
            argv += ["--internal-port", str(internal), "--internal-api-key-file", str(key_file)]
            gateways.append(_start(f"gateway-{i}", argv, f"http://127.0.0.1:{port}", logs))
            gateways[-1].internal_url = f"http://127.0.0.1:{internal}"
        children += gateways
        deadline = time.monotonic() + 60
        for gateway in gateways:
            _wait_ready(gateway, deadline)
            while time.monotonic() < deadline:  # its first probe round marks the replicas
                url = gateway.internal_url + "/internal/deployments"
                stats = httpx.get(url, headers=INTERNAL, timeout=5).json()
                if stats[0]["ready_replicas"] == 2:
                    break
                time.sleep(0.2)
        yield Fleet(engines, gateways, redis, spare, children)
    finally:
        for child in children:
            if child.proc.poll() is None:
                child.proc.kill()
        for child in children:
            child.proc.wait(timeout=30)
        redis.kill()
        redis.wait(timeout=10)


def test_chat_answer_with_exact_prompt_tokens_reserved(fleet: Fleet) -> None:
    # The gateway loads the model's tokenizer in the background; wait until it counts with it.
    deadline = time.monotonic() + 120
    while fleet.stats()["prompt_token_count"] != "tokenizer":
        assert time.monotonic() < deadline, "the gateway never loaded the tokenizer"
        time.sleep(0.5)
    client = fleet.client("counted", timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=16,
    )
    reply = raw.parse()
    assert "Paris" in (reply.choices[0].message.content or "")
    assert raw.headers["x-servefleet-route"] == "pool"
    assert reply.usage is not None
    # Reserved at admission: the engine's own prompt count (from the real tokenizer and chat
    # template) + max_tokens, taken from a full window.
    reserved = reply.usage.prompt_tokens + 16
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) == 100_000 - reserved


def test_streaming_with_usage_sync_and_async(fleet: Fleet) -> None:
    client = fleet.client("acme", timeout=120)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text and usage is not None and 0 < usage.completion_tokens <= 6

    async def plain_stream() -> list[Any]:
        async with fleet.aclient("acme", gateway=1, timeout=120) as aclient:
            stream = await aclient.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=5, stream=True
            )
            return [chunk async for chunk in stream]

    streamed = asyncio.run(plain_stream())
    assert "".join(c.choices[0].text for c in streamed if c.choices)
    assert all(c.usage is None for c in streamed)  # not asked for: the gateway hides it


def test_tenant_limits_hold_across_two_gateways_sharing_redis(fleet: Fleet) -> None:
    # bursty's tokens per minute cover exactly 5 requests; 20 arrive at once, 10 per gateway.
    async def burst() -> list[int]:
        clients = [fleet.aclient("bursty", gateway=g, max_retries=0, timeout=120) for g in (0, 1)]

        async def one(client: openai.AsyncOpenAI) -> int:
            try:
                await client.completions.create(
                    model=MODEL,
                    prompt=ID_PROMPT,
                    max_tokens=4,
                    extra_body={"ignore_eos": True},
                )
            except openai.RateLimitError as exc:
                assert exc.response.headers["x-ratelimit-limit-tokens"] == str(
                    5 * BURST_REQUEST_TOKENS
                )
                assert int(exc.response.headers["retry-after"]) >= 1
                return 429
            return 200

        try:
            return await asyncio.gather(*(one(clients[i % 2]) for i in range(20)))
        finally:
            for client in clients:
                await client.close()

    codes = asyncio.run(burst())
    assert codes.count(200) == 5 and codes.count(429) == 15


def test_least_load_routing_uses_both_replicas(fleet: Fleet) -> None:
    before = [engine_served(e.url) for e in fleet.engines]

    async def fan_out() -> None:
        async with fleet.aclient("acme", timeout=120) as client:
            await asyncio.gather(
                *(
                    client.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=3)
                    for i in range(6)
                )
            )

    asyncio.run(fan_out())
    after = [engine_served(e.url) for e in fleet.engines]
    gained = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(gained) == 6
    assert min(gained) >= 2, gained  # least outstanding work spreads a burst over both


def _set_replicas(fleet: Fleet, endpoints: list[str], gateway: int = 0) -> None:
    update = httpx.post(
        fleet.gateways[gateway].internal_url + f"/internal/deployments/{DEPLOYMENT}/replicas",
        json={"endpoints": endpoints, "ready": endpoints},
        headers=INTERNAL,
        timeout=10,
    )
    assert update.status_code == 200


def test_a_stream_survives_the_sigkill_of_its_engine(fleet: Fleet) -> None:
    """The spare holds a greedy stream and is SIGKILLed mid-stream: the client's text equals an
    uninterrupted run's, with one id, the whole answer's usage and no error."""
    victim, survivor = fleet.spare, fleet.engines[1]
    body = {"model": MODEL, "prompt": "Tell a long story about a lighthouse.", "max_tokens": 96}
    body |= {"temperature": 0, "ignore_eos": True}
    headers = {"authorization": "Bearer key-acme"}
    gateway = fleet.gateways[1]  # the tests below read gateway 0's replica states
    reference = httpx.post(survivor.url + "/v1/completions", json=body, timeout=180).json()
    continuations = gateway_counter(
        gateway.internal_url, "servefleet_gateway_stream_continuations_total"
    )
    _set_replicas(fleet, [victim.url], gateway=1)  # the stream must start on the victim
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, ids, usage, arrivals, killed_at = "", set(), None, [], None
    try:
        with httpx.stream(
            "POST", gateway.url + "/v1/completions", json=stream, headers=headers, timeout=180
        ) as r:
            assert r.headers["x-servefleet-continuation"] == "exact"
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                ids.add(event["id"])
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    text += choice["text"]
                    arrivals.append(time.monotonic())
                if killed_at is None and len(arrivals) >= 24:
                    _set_replicas(fleet, [victim.url, survivor.url], gateway=1)
                    victim.proc.send_signal(signal.SIGKILL)
                    victim.proc.wait(timeout=10)
                    killed_at = time.monotonic()
    finally:
        _set_replicas(fleet, [e.url for e in fleet.engines], gateway=1)
    assert killed_at is not None, "the stream ended before the kill"
    # Events already buffered arrive after the kill too: the stall is the longest gap.
    gaps = sorted(b - a for a, b in itertools.pairwise(arrivals))
    print(f"longest gap (the resume) {gaps[-1]:.3f}s, median gap {gaps[len(gaps) // 2]:.3f}s")
    assert text == reference["choices"][0]["text"]
    assert len(ids) == 1
    assert usage is not None and usage["completion_tokens"] == 96
    assert usage["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    after = gateway_counter(gateway.internal_url, "servefleet_gateway_stream_continuations_total")
    assert after == continuations + 1


def test_draining_replica_gets_no_new_requests(fleet: Fleet) -> None:
    draining, other = fleet.engines
    # A long request keeps the SIGTERMed engine draining (not gone) while the test runs.
    long_request = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import httpx,sys; httpx.post(sys.argv[1] + '/v1/completions', timeout=300, json="
            "{'model': sys.argv[2], 'prompt': 'Tell a long story.', 'max_tokens': 400, "
            "'ignore_eos': True})",
            draining.url,
            MODEL,
        ]
    )
    try:
        deadline = time.monotonic() + 60
        while "vllm:num_requests_running" not in _running(draining.url):
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.2)
        served_before = fleet.replica(draining.url)["served"]
        draining.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(draining.url + "/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "the engine did not start draining"
            time.sleep(0.1)
        other_before = engine_served(other.url)
        client = fleet.client("acme", timeout=120)
        for i in range(4):
            reply = client.completions.create(model=MODEL, prompt=f"Say {i}", max_tokens=2)
            assert reply.choices[0].text is not None
        assert engine_served(other.url) - other_before == 4
        replica = fleet.replica(draining.url)
        assert replica["state"] == "draining"
        assert replica["served"] == served_before  # it was offered at most its 503, no work
        assert draining.proc.poll() is None  # still draining its long request meanwhile
    finally:
        long_request.kill()
        long_request.wait(timeout=10)


def _running(url: str) -> str:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return ""
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", text, re.M)
    return "vllm:num_requests_running" if found and float(found.group(1)) >= 1 else ""


def test_killed_replica_is_ejected_and_the_request_retried_elsewhere(fleet: Fleet) -> None:
    survivor = fleet.engines[1]
    victim = fleet.spare
    update = httpx.post(
        fleet.gateways[0].internal_url + f"/internal/deployments/{DEPLOYMENT}/replicas",
        json={"endpoints": [survivor.url, victim.url], "ready": [survivor.url, victim.url]},
        headers=INTERNAL,
        timeout=10,
    )
    assert update.status_code == 200
    gateway = fleet.gateways[0].internal_url
    retries = gateway_counter(gateway, "servefleet_gateway_upstream_retries_total")
    victim.proc.kill()
    victim.proc.wait(timeout=10)

    async def fan_out() -> list[str]:
        async with fleet.aclient("acme", max_retries=0, timeout=120) as client:
            replies = await asyncio.gather(
                *(
                    client.completions.create(model=MODEL, prompt=f"Hi {i}", max_tokens=2)
                    for i in range(4)
                )
            )
        return [r.choices[0].text for r in replies]

    assert len(asyncio.run(fan_out())) == 4  # every request answered, none saw the failure
    assert fleet.replica(victim.url)["state"] == "ejected"
    assert gateway_counter(gateway, "servefleet_gateway_replica_ejections_total") >= 1
    assert gateway_counter(gateway, "servefleet_gateway_upstream_retries_total") > retries
