"""uvicorn's HTTP/1.1 protocol with deadlines on each request's head and body.

uvicorn times out idle keep-alive connections but never a request that is still arriving: a
client sending a header byte a second (slowloris), or full headers and then a body byte a
second, holds a connection, a task and a buffer for as long as it likes. Here

- the head (request line and headers) must be complete within `HEAD_TIMEOUT_S` of its first
  byte (or of the connection, for the first request) and stay under `MAX_HEADER_BYTES`;
- the body must keep up: it has `BODY_GRACE_S` after its head, plus one second for every
  `BODY_MIN_BYTES_PER_S` that arrive (so a 1 MiB body may take 26 s, the largest one allowed,
  16 MiB, 266 s, and a byte a second is cut after ~10 s). Time while the server itself holds
  the body back (the app has not read what came, or not yet asked a client that sent
  `Expect: 100-continue` for it) does not count.

Otherwise the answer is 408 (or 431) and the connection is closed. The engine and the gateway
both serve with it, in Kubernetes and in local mode. Written by hand because uvicorn has no
such setting (its `h11_max_incomplete_event_size` covers only the h11 implementation, and no
implementation has a head or body timeout).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from servefleet.api.openai_wire import MAX_HEADER_BYTES

HEAD_TIMEOUT_S = 10.0
BODY_GRACE_S = 10.0
BODY_MIN_BYTES_PER_S = 64 * 1024


def _closing_response(status: int, reason: str) -> bytes:
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    ).encode()


class BoundedHeadProtocol(HttpToolsProtocol):
    """HttpToolsProtocol whose request heads and bodies have deadlines (heads a size limit)."""

    head_timeout_s = HEAD_TIMEOUT_S
    body_grace_s = BODY_GRACE_S
    body_min_bytes_per_s = BODY_MIN_BYTES_PER_S
    _head_timer: asyncio.TimerHandle | None = None
    _in_head = False  # between a head's first byte (or the connection) and its end
    _head_bytes = 0
    _body_timer: asyncio.TimerHandle | None = None
    _body_deadline = 0.0  # loop time by which the body must have arrived (extended as it does)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:
            self._start_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head:  # the whole chunk went into a head that is still not complete
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEADER_BYTES:
                self._refuse(431, "Request Header Fields Too Large")

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        self._disarm_head_timer()
        super().on_headers_complete()
        # Until the message completes a body is due (a GET completes in this same call).
        self._body_deadline = self.loop.time() + self.body_grace_s
        self._arm_body_timer()

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._body_deadline += len(body) / self.body_min_bytes_per_s

    def on_message_complete(self) -> None:
        self._disarm_body_timer()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._disarm_body_timer()
        super().connection_lost(exc)

    # ---- the head -------------------------------------------------------------------------
    def _start_head(self) -> None:
        self._in_head, self._head_bytes = True, 0
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(
            self.head_timeout_s, self._refuse, 408, "Request Timeout"
        )

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    # ---- the body -------------------------------------------------------------------------
    def _arm_body_timer(self) -> None:
        self._disarm_body_timer()
        self._body_timer = self.loop.call_at(self._body_deadline, self._check_body)

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _check_body(self) -> None:
        self._body_timer = None
        now = self.loop.time()
        cycle = self.cycle
        held_by_us = self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue)
        if held_by_us:
            self._body_deadline = max(self._body_deadline, now + self.body_grace_s)
        if now < self._body_deadline:
            self._arm_body_timer()
            return
        if cycle is not None:
            # The app waiting on the body sees a disconnect; nothing it sends goes out.
            started = cycle.response_started
            cycle.disconnected = True
            cycle.message_event.set()
            if started:  # its answer is under way: nothing can be said, only hung up
                self.transport.close()
                return
        self._refuse(408, "Request Timeout")

    def _refuse(self, status: int, reason: str) -> None:
        """Answer and hang up: the request is too slow or too big to be worth reading."""
        self._disarm_head_timer()
        self._disarm_body_timer()
        if not self.transport.is_closing():
            self.transport.write(_closing_response(status, reason))
            self.transport.close()
