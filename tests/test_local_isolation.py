"""`servefleet up` is secure by default (issue 23): engines listen on loopback only and require
a key generated for the run (in their environment, not on their command line) that only the
gateway holds, and the local gateway cuts slow heads and bodies."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from servefleet.api.http_protocol import BoundedHeadProtocol
from servefleet.api.manifests import load_llmdeployments
from servefleet.local.engine_command import ENGINE_HOST
from servefleet.local.plane import LocalControlPlane, LocalOptions
from servefleet.local.ports import free_port
from servefleet.local.tenants import resolve_local_tenants
from tests.support.local_fakes import FAKE_ENGINE, MANIFEST

# The stand-in engine, requiring the key its environment names, as `servefleet engine` does.
KEYED_ENGINE = FAKE_ENGINE.replace(
    "    def do_POST(self):\n",
    "    def do_POST(self):\n"
    "        import os\n"
    "        key = os.environ['SERVEFLEET_API_KEY']\n"
    "        if self.headers.get('Authorization') != 'Bearer ' + key:\n"
    "            return self._send(401, '{}')\n",
)

REAL_MANIFEST = """
apiVersion: servefleet.io/v1alpha1
kind: LLMDeployment
metadata: {name: real}
spec:
  model: {name: smollm2, source: {builtin: smollm2-135m-instruct}}
  pool: {minReplicas: 1, maxReplicas: 1}
  autoscaling: {enabled: false}
  engine: {kvCacheMemory: 64MiB}
"""


def _plane(
    tmp_path: Path, manifest_text: str, host: str, command: Callable[..., list[str]] | None
) -> LocalControlPlane:
    manifest = tmp_path / "llmd.yaml"
    manifest.write_text(manifest_text)
    tenants = resolve_local_tenants(load_llmdeployments(manifest), manifest)
    options = LocalOptions(log_dir=tmp_path / "logs", host=host, port=free_port(host))
    if command is not None:
        options.engine_command = command
    return LocalControlPlane(tenants.deployments, tenants, options)


async def _running(plane: LocalControlPlane, warm_s: float) -> AsyncIterator[LocalControlPlane]:
    await plane.start()
    try:
        await plane.wait_warm(warm_s)
        yield plane
    finally:
        await plane.stop()


def _proc(pid: int, what: str) -> bytes:
    return Path(f"/proc/{pid}/{what}").read_bytes()


@pytest.fixture
async def keyed_plane(tmp_path: Path) -> AsyncIterator[LocalControlPlane]:
    script = tmp_path / "engine.py"
    script.write_text(KEYED_ENGINE)
    # The gateway on another loopback address: the engines stay on 127.0.0.1 all the same.
    plane = _plane(
        tmp_path,
        MANIFEST,
        "127.0.0.2",
        lambda spec, host, port: [sys.executable, str(script), str(port), "0.1"],
    )
    async for running in _running(plane, 20):
        yield running


async def test_engines_get_a_run_key_by_environment_and_listen_on_loopback(
    keyed_plane: LocalControlPlane,
) -> None:
    plane = keyed_plane
    key = plane.engine_key
    assert len(key) >= 32
    (replica,) = plane.supervisors["tiny"].live()
    assert urlsplit(replica.base_url).hostname == ENGINE_HOST
    assert key.encode() not in _proc(replica.process.pid, "cmdline")  # `ps` never shows it
    assert b"SERVEFLEET_API_KEY=" + key.encode() in _proc(replica.process.pid, "environ")
    (deployment,) = plane.gateway_config().deployments
    assert deployment.engine_api_key is not None and deployment.engine_api_key.read() == key
    assert deployment.allowed_replica_networks == [f"{ENGINE_HOST}/32"]
    body = {"model": "tiny-model", "messages": [{"role": "user", "content": "x"}]}
    async with httpx.AsyncClient(timeout=30) as client:
        direct = await client.post(f"{replica.base_url}/v1/chat/completions", json=body)
        assert direct.status_code == 401  # nothing bypasses the gateway
        tenant = {"Authorization": f"Bearer {plane.tenants.demo_key}"}
        through = await client.post(f"{plane.base_url}/chat/completions", json=body, headers=tenant)
        assert through.status_code == 200, through.text  # the gateway holds the key


async def test_each_run_has_its_own_key(tmp_path: Path) -> None:
    first = _plane(tmp_path, MANIFEST, "127.0.0.1", None)
    second = _plane(tmp_path, MANIFEST, "127.0.0.1", None)
    assert first.engine_key != second.engine_key


async def test_the_local_gateway_cuts_slow_heads_and_bodies(
    keyed_plane: LocalControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same protocol class, with deadlines short enough for a test.
    monkeypatch.setattr(BoundedHeadProtocol, "head_timeout_s", 0.5)
    monkeypatch.setattr(BoundedHeadProtocol, "body_grace_s", 0.5)
    address = (keyed_plane.options.host, keyed_plane.options.port)

    def answer(first_bytes: bytes) -> bytes:
        with socket.create_connection(address) as sock:
            sock.sendall(first_bytes)
            sock.settimeout(10)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            return data

    started = time.monotonic()
    slow_head = await asyncio.to_thread(answer, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x")
    key = (keyed_plane.tenants.demo_key or "").encode()
    slow_body = await asyncio.to_thread(
        answer,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        b"Content-Length: 500\r\n\r\n{" % key,
    )
    assert slow_head.startswith(b"HTTP/1.1 408 ") and slow_body.startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - started < 15  # cut at the deadlines, not at the 10 s reads


async def test_a_real_engine_started_by_up_refuses_requests_without_the_key(
    tmp_path: Path,
) -> None:
    plane = _plane(tmp_path, REAL_MANIFEST, "127.0.0.1", None)
    async for running in _running(plane, 600):
        (replica,) = running.supervisors["real"].live()
        assert running.engine_key.encode() not in _proc(replica.process.pid, "cmdline")
        async with httpx.AsyncClient(base_url=replica.base_url, timeout=60) as client:
            for path, body in (
                ("/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}),
                ("/tokenize", {"prompt": "Hi"}),
                ("/detokenize", {"tokens": [1, 2]}),
            ):
                refused = await client.post(path, json=body)
                assert refused.status_code == 401, path
            assert (await client.get("/ready")).status_code == 200  # probes stay open
            keyed = {"Authorization": f"Bearer {running.engine_key}"}
            assert (await client.post("/tokenize", json={"prompt": "Hi"}, headers=keyed)).is_success
        tenant = {"Authorization": f"Bearer {running.tenants.demo_key}"}
        async with httpx.AsyncClient(base_url=running.base_url, timeout=120) as client:
            body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4}  # fmt: skip
            reply = await client.post("/chat/completions", json=body, headers=tenant)
            assert reply.status_code == 200, reply.text
