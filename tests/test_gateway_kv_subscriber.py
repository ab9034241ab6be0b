"""Following a replica's KV event stream: applied to the index, resumed with Last-Event-ID
after a break, a replica without events (404) left alone, an unreachable one dropped."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from servefleet.api.kv_events import EVENTS_PATH, KVHello, KVSnapshot
from servefleet.api.kv_transfer import hash_hex
from servefleet.bench import processes
from servefleet.gateway.kv_index import KVIndex
from servefleet.gateway.kv_subscriber import follow

H1, H2, H3 = 0x11, 0x22, 0x33
HELLO = {"epoch": "e", "block_size": 16, "num_blocks": 100, "bytes_per_token": 10}


def _sse(event: str, data: dict[str, Any], ident: str | None = None) -> bytes:
    head = f"id: {ident}\n" if ident else ""
    return f"{head}event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def _pair(h: int) -> list[str]:
    return [hash_hex(h), hash_hex(0)]


def _engine(seen: list[str | None]) -> Starlette:
    async def events(request: Request) -> Response:
        last = request.headers.get("last-event-id")
        seen.append(last)

        async def first() -> AsyncIterator[bytes]:
            yield _sse("hello", HELLO)
            yield _sse("snapshot", {"seq": 1, "stored": [_pair(H1), _pair(H2)]}, "e-1")
            yield _sse("batch", {"seq": 2, "ts": 0, "stored": [_pair(H3)]}, "e-2")
            # ...and the stream breaks

        async def resumed() -> AsyncIterator[bytes]:
            yield _sse("hello", HELLO)
            yield _sse("batch", {"seq": 3, "ts": 0, "removed": [hash_hex(H1)]}, "e-3")
            await asyncio.sleep(30)

        body = first() if last is None else resumed()
        return StreamingResponse(body, media_type="text/event-stream")

    return Starlette(routes=[Route(EVENTS_PATH, events)])


async def _until(check: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_broken_stream_resumes_from_its_last_event() -> None:
    seen: list[str | None] = []
    index = KVIndex()
    with processes.serve_in_thread(_engine(seen), lifespan="off") as url:
        async with httpx.AsyncClient(timeout=10) as client:
            task = asyncio.create_task(follow(client, url, index, {}))
            try:
                await _until(lambda: len(seen) >= 2 and index.held_runs((H2,)) == {url: 1})
                await _until(lambda: not index.holders.get(H1))
                assert seen[:2] == [None, "e-2"]
                assert index.held_runs((H2, H3)) == {url: 2}
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


async def test_a_replica_without_events_is_left_alone_and_a_dead_one_dropped() -> None:
    index = KVIndex()
    app = Starlette(routes=[Route(EVENTS_PATH, lambda r: JSONResponse({}, status_code=404))])
    with processes.serve_in_thread(app, lifespan="off") as url:
        async with httpx.AsyncClient(timeout=10) as client:
            await asyncio.wait_for(follow(client, url, index, {}), 10)  # returns: no events
    index.hello(url, KVHello.model_validate(HELLO))
    index.snapshot(url, KVSnapshot(seq=1, stored=[(hash_hex(H1), hash_hex(0))]))
    assert index.held_runs((H1,)) == {url: 1}
    async with httpx.AsyncClient(timeout=2) as client:  # the server is gone now
        task = asyncio.create_task(follow(client, url, index, {}))
        try:
            await _until(lambda: index.held_runs((H1,)) == {})
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
