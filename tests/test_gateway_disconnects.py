"""Clients that leave are routine: the `servefleet gateway` process logs no traceback for them.

A real gateway process (uvloop, the bounded-head protocol) in front of a slow stand-in
replica; clients leave mid-stream (closing, and resetting the connection), while waiting for
a whole answer, and while queued. The engine once logged an `InvalidStateError` traceback for
every such client (`servefleet.engine.server`); the gateway's own waiting
(`client_watch.unless_client_leaves`, the relay's stream) must not either.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import threading
import time
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import httpx

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.llmdeployment import PoolSpec
from servefleet.bench.fake_upstream import FakeBehaviour, FakeOpenAI
from servefleet.bench.processes import free_port, serve_in_thread, servefleet_command

AUTH = {"authorization": "Bearer key-a"}
BODY: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 200,
}


def start_gateway(upstream: str, tmp_path: Path, stack: ExitStack) -> tuple[str, Path]:
    port = free_port()
    config = GatewayConfig(
        host="127.0.0.1",
        port=port,
        internal_port=None,
        tenants=[GatewayTenant(name="a", api_keys=[ApiKeyRef(sha256=hash_api_key("key-a"))])],
        deployments=[
            GatewayDeployment(
                name="d",
                model="m",
                endpoints=[upstream],
                tenants=[TenantAccess(name="a")],
                pool=PoolSpec(per_replica_concurrency=1),  # a second request queues
            )
        ],
    )
    config_file, log = tmp_path / "gateway.json", tmp_path / "gateway.log"
    config_file.write_text(config.model_dump_json())  # keeps internal_port: null
    argv = [*servefleet_command(), "gateway", "--config", str(config_file), "--log-level", "info"]
    out = stack.enter_context(log.open("wb"))
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    stack.callback(proc.wait, 30)
    stack.callback(proc.terminate)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        with suppress(httpx.HTTPError):
            if httpx.get(base + "/ready").status_code == 200:
                break
        assert time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.2)
    time.sleep(1.5)  # its first probe round has marked the replica ready
    return base, log


def leave_mid_stream(base: str) -> None:
    body = {**BODY, "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", headers=AUTH, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break


def reset_mid_stream(base: str) -> None:
    """Send a streaming request, read a little, then reset the connection (RST, no FIN)."""
    host, port = base.removeprefix("http://").split(":")
    payload = json.dumps({**BODY, "stream": True}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer key-a\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + payload)
        sock.recv(4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def leave_whole_answer(base: str) -> None:
    with suppress(httpx.TimeoutException):
        httpx.post(base + "/v1/chat/completions", headers=AUTH, json=BODY, timeout=0.5)


def leave_the_queue(base: str) -> None:
    holder = threading.Thread(target=leave_whole_answer, args=(base,))
    holder.start()
    time.sleep(0.2)
    leave_whole_answer(base)  # queued behind the holder's only slot, then gone
    holder.join()


def test_clients_leaving_log_no_traceback(tmp_path: Path) -> None:
    slow = FakeOpenAI(FakeBehaviour(completion_tokens=200, token_delay_s=0.05))
    with ExitStack() as stack:
        upstream = stack.enter_context(serve_in_thread(slow))
        base, log = start_gateway(upstream, tmp_path, stack)
        for leave in (leave_mid_stream, reset_mid_stream, leave_whole_answer, leave_the_queue):
            for _ in range(2):
                leave(base)
        deadline = time.monotonic() + 15
        while slow.stats.active and time.monotonic() < deadline:
            time.sleep(0.1)  # every upstream was dropped: the replica is idle again
        assert slow.stats.active == 0
        ok = httpx.post(
            base + "/v1/chat/completions", headers=AUTH, json={**BODY, "max_tokens": 2}, timeout=30
        )
        assert ok.status_code == 200  # and nothing was left holding the only slot
    logged = log.read_text(errors="replace")
    assert "Traceback" not in logged and "InvalidStateError" not in logged, logged[-3000:]
    assert "Application startup complete" in logged  # the log is the gateway's, and read
