"""Attacks below HTTP clients: raw sockets that send a head or a body too slowly, or a head too
large. Each returns what the server did (its status line, if any) and when it hung up, so a
scenario can check that the connection was cut, and how soon."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class CutResult:
    """What the server did to one hostile connection."""

    status: int | None  # the status line's code, None when it closed without answering
    seconds: float  # from the first byte sent until the server answered or closed
    cut: bool  # the server ended it (not the attacker giving up)


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None, url
    return parts.hostname, parts.port


def _status(data: bytes) -> int | None:
    if data.startswith(b"HTTP/1."):
        try:
            return int(data.split(b" ", 2)[1])
        except (IndexError, ValueError):
            return None
    return None


def _answer(sock: socket.socket) -> bytes | None:
    """What the server sent so far (b"" once it closed), or None when it sent nothing yet."""
    sock.setblocking(False)
    try:
        return sock.recv(4096)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""
    finally:
        sock.setblocking(True)


def _trickle(
    sock: socket.socket, head: bytes, body: bytes, interval_s: float, max_s: float
) -> CutResult:
    """Sends `head` at once, then `body` one byte per `interval_s`, until the server answers or
    closes, or `max_s` passes."""
    start = time.monotonic()
    sock.sendall(head)
    for byte in body:
        answer = _answer(sock)
        if answer is not None:
            return CutResult(_status(answer), round(time.monotonic() - start, 2), True)
        if time.monotonic() - start > max_s:
            break
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return CutResult(None, round(time.monotonic() - start, 2), True)
        time.sleep(interval_s)
    return CutResult(None, round(time.monotonic() - start, 2), False)


def slow_body(
    url: str, path: str, key: str, *, interval_s: float = 1.0, max_s: float = 90.0
) -> CutResult:
    """A whole head (with `key`, so it is not refused before the body), then a JSON body at
    one byte per `interval_s`."""
    host, port = _address(url)
    body = b'{"model": "x", "messages": [' + b" " * 4096 + b"]}"
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {key}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, port), timeout=10) as sock:
        return _trickle(sock, head, body, interval_s, max_s)


def slow_head(url: str, *, interval_s: float = 1.0, max_s: float = 90.0) -> CutResult:
    """A request head at one byte per `interval_s` (slowloris)."""
    host, port = _address(url)
    head = f"GET /health HTTP/1.1\r\nhost: {host}:{port}\r\n" + "x-pad: " + "a" * 4096
    with socket.create_connection((host, port), timeout=10) as sock:
        return _trickle(sock, b"", head.encode(), interval_s, max_s)


def slowloris(url: str, connections: int, **kwargs: float) -> list[CutResult]:
    """`connections` slow heads at once; the result of each."""
    results: list[CutResult] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            found = slow_head(url, **kwargs)
        except OSError:
            found = CutResult(None, 0.0, True)  # refused outright: cut before it began
        with lock:
            results.append(found)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def huge_head(url: str, size: int, *, max_s: float = 60.0) -> CutResult:
    """A request head of `size` bytes sent as fast as the server takes it."""
    host, port = _address(url)
    start = time.monotonic()
    chunk = b"x-pad: " + b"a" * 65530 + b"\r\n"  # one well-formed header line, many times
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nhost: {host}:{port}\r\n".encode())
        sent = 0
        while sent < size and time.monotonic() - start < max_s:
            answer = _answer(sock)
            if answer is not None:
                return CutResult(_status(answer), round(time.monotonic() - start, 2), True)
            try:
                sock.sendall(chunk)
            except OSError:
                break
            sent += len(chunk)
        sock.settimeout(max(1.0, max_s - (time.monotonic() - start)))
        try:
            answer = sock.recv(4096)
        except OSError:
            answer = b""
    elapsed = round(time.monotonic() - start, 2)
    return CutResult(_status(answer), elapsed, sent < size or bool(answer))
