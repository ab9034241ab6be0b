"""uvicorn's HTTP/1.1 protocol with a deadline and a size bound on each request's head.

uvicorn times out idle keep-alive connections but never a request whose head (request line
and headers) is still arriving: a client sending a header byte a second (slowloris) holds a
connection and its buffer for as long as it likes. Here the head must be complete within
`HEAD_TIMEOUT_S` of its first byte (or of the connection, for the first request) and stay under
`MAX_HEADER_BYTES`; otherwise the answer is 408 or 431 and the connection is closed. The engine
and the gateway both serve with it. Written by hand because uvicorn has no such setting (its
`h11_max_incomplete_event_size` covers only the h11 implementation, and no implementation has a
head timeout).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from servefleet.api.openai_wire import MAX_HEADER_BYTES

HEAD_TIMEOUT_S = 10.0


def _closing_response(status: int, reason: str) -> bytes:
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    ).encode()


class BoundedHeadProtocol(HttpToolsProtocol):
    """HttpToolsProtocol whose request heads have a deadline and a size limit."""

    head_timeout_s = HEAD_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None
    _in_head = False  # between a head's first byte (or the connection) and its end
    _head_bytes = 0

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

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

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

    def _refuse(self, status: int, reason: str) -> None:
        """Answer and hang up: the head is too slow or too big to be worth reading."""
        self._disarm_head_timer()
        if not self.transport.is_closing():
            self.transport.write(_closing_response(status, reason))
            self.transport.close()
