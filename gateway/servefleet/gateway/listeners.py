"""Serving the gateway: the tenant port and the internal port from one server, one event loop.

The internal port (`/metrics`, `/internal/*`) is a second listening socket of the same uvicorn
server, not a second server: one loop, one set of signal handlers, one lifespan (the tenant
app's, which starts and stops the gateway). A request is handed to the app of the socket it
arrived on, read from the ASGI scope's `server` address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servefleet.gateway.asgi import Receive, Scope, Send

ASGIApp = Any  # an ASGI callable; uvicorn's own type is not exported


@dataclass(frozen=True)
class ByListener:
    """Routes each connection by the port it was accepted on; lifespan goes to `tenant`."""

    tenant: ASGIApp
    internal: ASGIApp
    internal_port: int

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if scope["type"] != "lifespan" and server and server[1] == self.internal_port:
            await self.internal(scope, receive, send)
        else:
            await self.tenant(scope, receive, send)
