"""A batch line as an in-process request to the gateway's own completion handler: the same
parsing, limits, budgets, admission, routing and access log as a tenant's call, as the tenant
who owns the batch and in the `batch` traffic class.

The tenant and the class ride in scope keys no HTTP request can set (a server builds the
scope from the wire; only in-process callers add keys), so no key is needed or kept.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from servefleet.api.openai_errors import OpenAIError, error_bytes
from servefleet.gateway.asgi import Message, Receive, Scope, Send

log = logging.getLogger("servefleet.gateway.batches")
_INTERNAL = error_bytes(
    message="Internal error in the gateway (logged there).",
    type="server_error",
    code="internal_error",
)

TRUSTED_TENANT = "servefleet.tenant"
TRAFFIC_CLASS = "servefleet.traffic_class"
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


async def call_in_process(
    handle: Handler, tenant: str, path: str, body: bytes
) -> tuple[int, bytes, str]:
    """(status, body, request id) of one non-streamed request through `handle`."""
    scope: Scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": None,
        TRUSTED_TENANT: tenant,
        TRAFFIC_CLASS: "batch",
    }
    answered = asyncio.Event()
    sent_body = False
    status = 500
    request_id = ""
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()  # the "client" stays until the answer is complete
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, request_id
        if message["type"] == "http.response.start":
            status = int(message["status"])
            for key, value in message.get("headers", ()):
                if key == b"x-request-id":
                    request_id = value.decode("latin-1")
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                answered.set()

    try:
        await handle(scope, receive, send)
    except OpenAIError as exc:  # a refusal before the answer started, as the tenant gets it
        return exc.status, exc.body_bytes(), request_id
    except Exception:
        log.exception("batch_line_failed path=%s tenant=%s", path, tenant)
        return 500, _INTERNAL, request_id
    finally:
        answered.set()
    return status, b"".join(chunks), request_id
