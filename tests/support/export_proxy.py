"""A KV export source in front of a real engine's: it delays, cuts or counts exports, so the
transfer tests can make a source slow, die mid-stream or be asked twice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from servefleet.api.kv_transfer import EXPORT_PATH


def export_proxy(
    source: str,
    *,
    cut_after: int | None = None,
    delay_s: float = 0.0,
    exports: list[int] | None = None,
) -> Starlette:
    """An export source in front of the real one: it waits `delay_s`, forwards the stream
    (only `cut_after` bytes of it, then dies, when given) and counts its exports."""

    async def export(request: Request) -> StreamingResponse:
        if exports is not None:
            exports.append(1)
        await asyncio.sleep(delay_s)
        body = await request.body()
        client = httpx.AsyncClient(timeout=60)
        req = client.build_request(
            "POST", source + EXPORT_PATH, content=body, headers=dict(request.headers)
        )
        resp = await client.send(req, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            sent = 0
            async for chunk in resp.aiter_raw():
                if cut_after is None:
                    yield chunk
                    continue
                yield chunk[: cut_after - sent]
                sent += len(chunk)
                if sent >= cut_after:
                    raise RuntimeError("the source died")
            await client.aclose()

        return StreamingResponse(relay(), media_type=resp.headers["content-type"])

    return Starlette(routes=[Route(EXPORT_PATH, export, methods=["POST"])])
