"""Send an upstream response (engine or hosted API) on to the client.

A whole body goes as it came, unless it is an error the tenant should see in OpenAI's shape; a
stream is relayed event by event (`proxy.SseRelay`). A client that leaves, streaming or not,
closes the upstream, which aborts the generation. What was relayed (usage, events, first byte,
whether it completed or the client left) is noted on the `Call`, for settling and for its
outcome (`call_outcome`); TTFT is measured here, where it happens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from servefleet.api.openai_errors import error_bytes
from servefleet.api.stream_resume import CONTINUATION_HEADER, SEED_HEADER
from servefleet.gateway.asgi import JSON, Headers, Receive, Send, respond
from servefleet.gateway.call import Call
from servefleet.gateway.client_watch import ClientGone, unless_client_leaves
from servefleet.gateway.errors import sse_error_event
from servefleet.gateway.proxy import SseRelay, upstream_error_message, usage_from_json
from servefleet.gateway.queueing import TrafficClass
from servefleet.gateway.upstream import UpstreamError, UpstreamResponse, UpstreamTimeout

ROUTE_POOL = b"pool"
ROUTE_SPILL = b"spillover"

_DONE, _LEFT, _BROKEN = "done", "left", "broken"  # how one replica's stream ended

Resume = Callable[[], Awaitable[UpstreamResponse | None]]


class Relay:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock

    async def relay(
        self,
        call: Call,
        response: UpstreamResponse,
        send: Send,
        receive: Receive,
        *,
        spill: bool,
        resume: Resume | None = None,
    ) -> bool:
        """Send the upstream response to the client; True when it completed.

        A stream whose replica breaks is continued with `resume` when given (`stream_splice`).
        """
        headers = [
            (b"content-type", response.header(b"content-type") or JSON),
            (b"x-servefleet-route", ROUTE_SPILL if spill else ROUTE_POOL),
            (b"x-request-id", call.request_id.encode()),
            *call.rl_headers,
        ]
        if response.status != 200 or not call.stream:
            return await self._whole(call, response, send, receive, headers, spill, resume)
        return await self._stream(call, response, send, receive, headers, spill, resume)

    async def _whole(
        self,
        call: Call,
        response: UpstreamResponse,
        send: Send,
        receive: Receive,
        headers: Headers,
        spill: bool,
        resume: Resume | None,
    ) -> bool:
        """A whole answer; a replica failing while answering is asked of another (`resume`)."""
        status = response.status
        try:
            body = await unless_client_leaves(response.read(), receive)
        except ClientGone:
            response.close()
            return False  # nothing was delivered, so nothing is charged
        except UpstreamError as exc:
            response.close()
            call.timed_out = isinstance(exc, UpstreamTimeout)
            retry = await resume() if resume is not None and status == 200 else None
            if retry is not None:  # nothing reached the client yet: the whole answer again
                return await self._whole(call, retry, send, receive, headers, spill, None)
            code = 504 if isinstance(exc, UpstreamTimeout) else 502
            await respond(
                send,
                code,
                error_bytes(
                    message="The upstream failed while answering.",
                    type="upstream_error",
                    code="timeout",
                ),
                headers=headers[1:],
            )
            return False
        response.close()
        if status >= 400:
            return await _error(call, status, body, send, headers, spill=spill)
        call.used = usage_from_json(body)
        call.first_byte = True
        self._observe_ttft(call, spill)
        await respond(send, 200, body, headers=headers[1:], content_type=headers[0][1])
        call.completed = True
        return True

    async def _stream(
        self,
        call: Call,
        response: UpstreamResponse,
        send: Send,
        receive: Receive,
        headers: Headers,
        spill: bool,
        resume: Resume | None,
    ) -> bool:
        headers.append((b"cache-control", b"no-cache"))
        if call.splice is not None:
            mode = b"exact" if call.splice.exact else b"text"
            headers.append((CONTINUATION_HEADER.encode(), mode))
            if call.splice.seed is not None:
                headers.append((SEED_HEADER.encode(), str(call.splice.seed).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        relay = SseRelay(strip_usage=not call.wants_usage, splice=call.splice)
        gone = asyncio.ensure_future(receive())
        current: UpstreamResponse | None = response
        outcome = _BROKEN
        try:
            while current is not None:
                outcome = await self._pump(call, current, relay, send, gone, spill)
                current.close()
                if outcome != _BROKEN or resume is None:
                    break
                relay.restart()
                current = await resume()  # the next replica, or None: no continuation
        finally:
            gone.cancel()
            if current is not None:
                current.close()
        completed, left = outcome == _DONE, outcome == _LEFT
        tail = relay.flush()
        if outcome == _BROKEN:
            tail += sse_error_event("The upstream failed mid-stream.", "upstream_error")
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        call.used = relay.usage
        call.events = relay.events
        call.completed, call.client_left = completed, left
        return completed

    async def _pump(
        self,
        call: Call,
        response: UpstreamResponse,
        relay: SseRelay,
        send: Send,
        gone: asyncio.Future[Any],
        spill: bool,
    ) -> str:
        """Relay one replica's stream: _DONE, _LEFT (the client) or _BROKEN (the replica)."""
        splice = call.splice
        try:
            async for chunk in response.iter_chunks():
                out = relay.feed(chunk)
                if out:
                    if not call.first_byte:
                        call.first_byte = True
                        self._observe_ttft(call, spill)
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if gone.done():
                    return _LEFT  # closing the upstream aborts the generation
                if splice is not None and splice.broken:
                    return _BROKEN
        except UpstreamError as exc:
            call.timed_out = isinstance(exc, UpstreamTimeout)
            return _BROKEN  # reset, or no byte for `upstream_timeout_seconds`
        return _DONE if relay.done else _BROKEN

    def _observe_ttft(self, call: Call, spill: bool) -> None:
        ttft = self._clock() - call.started
        call.ttft_s = ttft
        call.route.metrics.ttft.observe(ttft)
        # The pool's own interactive TTFT is what its autoscaler acts on: a batch backlog may
        # wait, and must not buy replicas through its latency either.
        if not spill and call.route.traffic_class is TrafficClass.INTERACTIVE:
            call.route.pool.record_ttft(ttft)


async def _error(
    call: Call, status: int, body: bytes, send: Send, headers: Headers, *, spill: bool
) -> bool:
    """An upstream error answer; True when it is the client's own error (4xx), not a failure."""
    if spill and status not in (400, 404, 422):
        # Our key, their quota, their outage: not the tenant's error to see as-is.
        message = "The spill-over API failed: " + upstream_error_message(status, body)
        await respond(
            send,
            502,
            error_bytes(message=message, type="upstream_error", code="upstream_error"),
            headers=headers[1:],
        )
        return False
    content_type = headers[0][1]
    if b'"error"' not in body:
        body = error_bytes(message=upstream_error_message(status, body), type="upstream_error")
        content_type = JSON
    await respond(send, status, body, headers=headers[1:], content_type=content_type)
    return status < 500
