"""A scripted Kubernetes API server in the test's own event loop, and a client pointed at it.

Every request is recorded; `answer` says what to send back: a JSON body with a status, or a
watch stream of events (left open until the test ends when `hold` is set).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from servefleet.kube import KubeAccess, KubeClient


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any = None


@dataclass
class Stream:
    """A watch response: these events, one JSON line each."""

    events: list[dict[str, Any]]
    hold: bool = False


@dataclass
class FakeApi:
    answer: Callable[[Call], tuple[int, Any]]
    calls: list[Call] = field(default_factory=list)
    released: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        text = await request.text()
        call = Call(
            request.method,
            request.path,
            dict(request.query),
            {k.lower(): v for k, v in request.headers.items()},
            json.loads(text) if text else None,
        )
        self.calls.append(call)
        status, body = self.answer(call)
        if not isinstance(body, Stream):
            return web.json_response(body, status=status)
        response = web.StreamResponse(status=status)
        response.content_type = "application/json"
        await response.prepare(request)
        for event in body.events:
            await response.write(json.dumps(event).encode() + b"\n")
            await asyncio.sleep(0.01)
        if body.hold:
            await self.released.wait()
        return response


@asynccontextmanager
async def fake_kube(
    answer: Callable[[Call], tuple[int, Any]], token: str = "sa-token"
) -> AsyncIterator[tuple[FakeApi, KubeClient]]:
    """The fake server and a connected client, both closed on exit."""
    api = FakeApi(answer)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", api.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    kube = await KubeAccess(server=str(server.make_url("")), token=token).connect()
    try:
        yield api, kube
    finally:
        api.released.set()
        await kube.aclose()
        await server.close()
