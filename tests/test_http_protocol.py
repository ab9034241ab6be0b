"""Request heads have a deadline and a size bound (slowloris, huge headers), in a real uvicorn."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from servefleet.api.http_protocol import BoundedHeadProtocol
from servefleet.api.openai_wire import MAX_HEADER_BYTES
from servefleet.bench.processes import free_port


class QuickHeads(BoundedHeadProtocol):
    head_timeout_s = 0.5


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hi"})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        hello, host="127.0.0.1", port=port, http=QuickHeads, lifespan="off", log_level="error"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def _read_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def test_a_slow_head_is_answered_408_and_cut(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        started = time.monotonic()
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - started < 5  # cut by the deadline, not by the read timeout


def test_a_connection_that_never_speaks_is_cut(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        assert _read_all(sock).startswith(b"HTTP/1.1 408 ")


def test_a_huge_head_is_answered_431_and_cut(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1))
        assert _read_all(sock).startswith(b"HTTP/1.1 431 ")


def test_keep_alive_requests_are_served_and_idle_time_between_them_is_not_a_slow_head(
    port: int,
) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        sock.sendall(REQUEST)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        time.sleep(1.0)  # twice the head deadline, idle between requests
        sock.sendall(REQUEST)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
