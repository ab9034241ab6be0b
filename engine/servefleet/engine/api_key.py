"""`--api-key`: every path but the probes needs `Authorization: Bearer KEY`.

Probes and scrapes (/health, /ready, /metrics) and /version stay open: kubelet and Prometheus
carry no key. Everything else needs it, /tokenize, /detokenize and /openapi.json included:
the engine sits behind the gateway, and nothing that reaches its port without the key may use
it. Pure ASGI, so streamed responses pass through untouched; the comparison is on bytes (a
header that is not ASCII is a 401, never an error) and takes the same time whatever was sent.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from servefleet.api.openai_errors import error_body
from servefleet.api.openai_wire import send_json

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})

_UNAUTHORIZED = json.dumps(
    error_body(
        message="Incorrect or missing API key: send `Authorization: Bearer KEY`.",
        code="invalid_api_key",
    )
).encode()


def is_protected(path: str, root_path: str = "") -> bool:
    """True for every path but the open probes (behind an optional root path)."""
    rest = path.removeprefix(root_path) if root_path else path
    return rest not in OPEN_PATHS


def bearer_matches(authorization: bytes | None, api_key: str) -> bool:
    expected = f"Bearer {api_key}".encode()
    return authorization is not None and hmac.compare_digest(authorization, expected)


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("an empty API key would let every request in")
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope.get("method") != "OPTIONS"  # CORS preflights carry no credentials
            and is_protected(scope["path"], scope.get("root_path", ""))
        ):
            headers = dict(scope.get("headers") or [])
            if not bearer_matches(headers.get(b"authorization"), self.api_key):
                await send_json(send, 401, _UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)
