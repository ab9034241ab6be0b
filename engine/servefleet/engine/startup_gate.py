"""What the engine's port answers while the model loads.

The port is bound before the model loads, so a busy port fails at once and a prober sees
an answer rather than a refused connection: /health, /ready and every other path answer
503 "loading" (with Retry-After) until `open(app)` hands over to the real app. /health
stays 503 too, so a startup probe on it still waits for the model, exactly as before.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from servefleet.api.openai_errors import error_body
from servefleet.api.openai_wire import send_json

RETRY_AFTER_S = 5


def _body(path: str) -> bytes:
    if path == "/health":
        return json.dumps({"status": "loading", "detail": "loading"}).encode()
    if path == "/ready":
        return json.dumps({"ready": False, "detail": "loading"}).encode()
    return json.dumps(
        error_body(message="the engine is still loading", type="service_unavailable")
    ).encode()


class StartupGate:
    """An ASGI app: 503 "loading" until `open` is called, then the given app for good."""

    def __init__(self) -> None:
        self._app: ASGIApp | None = None

    @property
    def is_open(self) -> bool:
        return self._app is not None

    def open(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self._app
        if app is not None:
            await app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        retry_after = (b"retry-after", str(RETRY_AFTER_S).encode())
        await send_json(send, 503, _body(scope["path"]), [retry_after])
