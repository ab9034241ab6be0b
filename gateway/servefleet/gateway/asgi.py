"""The ASGI plumbing every handler shares: types, request bodies, whole responses.

Plain ASGI rather than a framework: every microsecond on this path is added latency for every
token stream.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from servefleet.api.openai_errors import OpenAIError
from servefleet.api.openai_wire import MAX_BODY_BYTES

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON = b"application/json"


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def read_body(receive: Receive) -> bytes:
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):
        return body
    parts = [body]
    size = len(body)
    while message.get("more_body"):
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise OpenAIError(
                status=413, message="The request body is too large.", code="request_too_large"
            )
        parts.append(chunk)
    return b"".join(parts)


async def respond(
    send: Send,
    status: int,
    body: bytes,
    *,
    headers: Headers | None = None,
    content_type: bytes = JSON,
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *(headers or ()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class StatusRecorder:
    """Wraps a `send` to remember the status it started the response with (the access log's)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status: int | None = None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and self.status is None:
            self.status = int(message["status"])
        await self._send(message)
