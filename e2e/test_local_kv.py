"""KV beyond one replica in local mode, with the real engine (SmolLM2) as real processes
under the in-process control plane (`servefleet up`'s plane):

- scale-up warm start: a pool of one serves a hot ~600-token prompt; scaled to two (as the
  local actuator scales it), the new replica answers kv-warming, the gateway's prober asks
  it to warm from the ready one, it imports blocks, and its first request on the hot prompt
  is a prefix-cache hit with the same greedy text;
- failover without recompute: scaled to three, a stream is SIGKILLed with its engine
  mid-answer; the gateway continues it on a peer that pulls the prompt's KV from the live
  replica holding it (its import counter grows), and the text equals an unbroken run.

Slow (up to three model processes on two cores): run it on its own,
    uv run pytest e2e/test_local_kv.py -s
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from servefleet.api.cache_salt import tenant_salt
from servefleet.api.kv_transfer import BLOCKS_METRIC
from servefleet.api.manifests import load_llmdeployments
from servefleet.autoscaler.signals import ReplicaState
from servefleet.local.plane import LocalControlPlane, LocalOptions
from servefleet.local.ports import free_port
from servefleet.local.supervisor import DeploymentSupervisor
from servefleet.local.tenants import DEMO_TENANT, resolve_local_tenants

MODEL = "smollm2-135m-instruct"
# Long enough to outlast the third replica's prefill of the same prompt (per-row attention in
# the CPU engine's batch-invariant mode makes that prefill the slower part).
STREAM_TOKENS = 480
MANIFEST = f"""
apiVersion: servefleet.io/v1alpha1
kind: LLMDeployment
metadata: {{name: smollm2}}
spec:
  model: {{name: {MODEL}, source: {{builtin: {MODEL}}}}}
  engine: {{maxNumSeqs: 4, drainTimeoutSeconds: 5, resources: {{requests: {{cpu: "1"}}}}}}
  pool: {{minReplicas: 1, maxReplicas: 3, perReplicaConcurrency: 4}}
  autoscaling: {{enabled: false}}
  admission: {{maxQueueDepth: 64, maxQueueWait: 120}}
"""
SENTENCE = "The harbour master logged ship {i} arriving with {j} crates of tea and spices. "


def _prompt(tag: str, sentences: int = 35) -> str:
    body = "".join(SENTENCE.format(i=i, j=i * 7 % 31) for i in range(sentences))
    return f"Log {tag}. {body}Now list every ship again, one per line:"


def _body(text: str, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


# An engine called directly gets what the gateway would have sent: the demo tenant's salt,
# under which the prefixes it served through the gateway are cached.
DEMO_SALT = {"cache_salt": tenant_salt(DEMO_TENANT, None)}


async def _stream(
    client: httpx.AsyncClient, url: str, key: str, body: dict[str, Any], events: list[str]
) -> dict[str, Any]:
    """Text and usage of a streamed completion; each text piece is appended to `events`."""
    usage: dict[str, Any] = {}
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", url + "/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                events += [c["text"] for c in event["choices"] if c.get("text")]
                usage = event.get("usage") or usage
    return {"text": "".join(events), "usage": usage}


async def _imported(client: httpx.AsyncClient, base: str) -> float:
    text = (await client.get(base + "/metrics")).text
    prefix = BLOCKS_METRIC + '{direction="import"'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))  # fmt: skip


async def _until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not in {timeout_s:g}s: {what}"
        await asyncio.sleep(0.2)


async def _ready_count(sup: DeploymentSupervisor, count: int) -> None:
    async def ready() -> bool:
        return sum(1 for r in sup.live() if r.state is ReplicaState.READY) >= count

    await _until(ready, 240, f"{count} ready replicas")


async def test_warm_start_then_failover_pull(tmp_path: Path) -> None:
    manifest = tmp_path / "llmd.yaml"
    manifest.write_text(MANIFEST)
    tenants = resolve_local_tenants(load_llmdeployments(manifest), manifest)
    options = LocalOptions(log_dir=tmp_path / "logs", port=free_port(), env=dict(os.environ))
    plane = LocalControlPlane(tenants.deployments, tenants, options)
    await plane.start()
    try:
        await plane.wait_warm(240)  # the first replica: no peer, so it is warmed at once
        sup = plane.supervisors["smollm2"]
        async with httpx.AsyncClient(timeout=300) as client:
            await _warm_start(plane, sup, client, tenants.demo_key)
            await _failover(plane, sup, client, tenants.demo_key)
    finally:
        await plane.stop()


async def _warm_start(
    plane: LocalControlPlane, sup: DeploymentSupervisor, client: httpx.AsyncClient, key: str
) -> None:
    hot = _prompt("hot")
    served = await _stream(client, plane.base_url, key, _body(hot, 8), [])
    (first,) = [r.base_url for r in sup.live()]
    sup.scale(2)  # what the local actuator does on an autoscaler's "up"
    await _ready_count(sup, 2)
    (new,) = [r.base_url for r in sup.live() if r.base_url != first]
    assert await _imported(client, new) > 0, "the new replica pulled nothing"
    direct = await _stream(client, new + "/v1", plane.engine_key, _body(hot, 8) | DEMO_SALT, [])
    cached = direct["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and direct["text"] == served["text"], (cached, direct, served)


async def _failover(
    plane: LocalControlPlane, sup: DeploymentSupervisor, client: httpx.AsyncClient, key: str
) -> None:
    sup.scale(3)
    await _ready_count(sup, 3)
    gateway = plane.gateway
    assert gateway is not None
    pool = gateway.pools["smollm2"]
    text = _prompt("failover")
    pieces: list[str] = []
    task = asyncio.create_task(
        _stream(client, plane.base_url, key, _body(text, STREAM_TOKENS), pieces)
    )
    await _until(lambda: _true(len(pieces) >= 2), 120, "the stream's first tokens")
    (victim,) = [r for r in pool.replicas.replicas.values() if r.outstanding]
    # where the gateway will continue it (the least loaded other replica), and the third,
    # which serves the same prompt now, so it holds its blocks when the stream breaks
    target = pool.replicas.pick(None, time.monotonic(), slack=0, exclude=victim)
    assert target is not None
    (holder,) = [e for e in pool.replicas.replicas if e not in (victim.endpoint, target.endpoint)]
    await _stream(client, holder + "/v1", plane.engine_key, _body(text, 1) | DEMO_SALT, [])
    assert not task.done(), "the stream ended before its engine could be killed"
    before = await _imported(client, target.endpoint)
    (pid,) = [r.process.pid for r in sup.live() if r.base_url == victim.endpoint]
    os.kill(pid, signal.SIGKILL)
    broken = await task
    assert await _imported(client, target.endpoint) > before, "the continuation pulled nothing"
    whole = await _stream(client, plane.base_url, key, _body(text, STREAM_TOKENS), [])
    assert broken["text"] == whole["text"]
    assert broken["usage"]["completion_tokens"] == STREAM_TOKENS


async def _true(value: bool) -> bool:
    return value
