"""Request heads and bodies have deadlines, heads a size bound (slowloris, slow bodies, huge
headers), in a real uvicorn."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from servefleet.api import http_protocol
from servefleet.api.http_protocol import BoundedHeadProtocol
from servefleet.api.openai_wire import MAX_HEADER_BYTES
from servefleet.bench.processes import free_port


class QuickHeads(BoundedHeadProtocol):
    head_timeout_s = 0.5
    body_grace_s = 0.5
    body_min_bytes_per_s = 1024


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """`/echo` reads the whole body and answers its length; any other path answers `hi`."""
    body = b"hi"
    if scope["path"] == "/echo":
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        body = str(size).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


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


def _post_head(length: int) -> bytes:
    return b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length


def test_the_deadlines_are_defined_once_in_api() -> None:
    assert BoundedHeadProtocol.body_grace_s == http_protocol.BODY_GRACE_S
    assert BoundedHeadProtocol.body_min_bytes_per_s == http_protocol.BODY_MIN_BYTES_PER_S
    # The largest body allowed at the slowest rate allowed: minutes, not forever.
    assert http_protocol.BODY_GRACE_S + (16 << 20) / http_protocol.BODY_MIN_BYTES_PER_S < 300


def test_a_body_sent_a_byte_at_a_time_is_answered_408_and_cut(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_post_head(100) + b"x")
        started = time.monotonic()
        for _ in range(40):  # a byte every 0.1 s: 10 bytes a second, under the 1 KiB/s rate
            time.sleep(0.1)
            try:
                sock.sendall(b"x")
            except OSError:
                break  # cut while sending: what the test wants
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert time.monotonic() - started < 3.5  # cut near the 0.5 s grace, not when the body ended


def test_a_body_that_stops_after_its_headers_is_cut(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_post_head(10))
        assert _read_all(sock).startswith(b"HTTP/1.1 408 ")


def test_a_body_at_a_fair_rate_may_take_longer_than_the_grace(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        chunks = 8
        sock.sendall(_post_head(chunks * 2048))
        for _ in range(chunks):  # 2 KiB every 0.15 s: 1.2 s in all, twice the 1 KiB/s rate
            sock.sendall(b"y" * 2048)
            time.sleep(0.15)
        answer = b""
        while not answer.endswith(b"0\r\n\r\n") and (chunk := sock.recv(65536)):
            answer += chunk  # chunked: the last chunk ends the answer
    assert answer.startswith(b"HTTP/1.1 200 ") and b"\r\n%d\r\n" % (chunks * 2048) in answer


def test_keep_alive_after_a_body_is_not_a_slow_body(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        sock.sendall(_post_head(3) + b"abc")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        time.sleep(1.0)  # twice the body grace, idle between requests
        sock.sendall(REQUEST)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
