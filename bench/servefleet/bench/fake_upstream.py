"""A small OpenAI-compatible server that stands in for a hosted API or an engine replica.

Benchmark tooling, also used by the tests: an instant upstream to measure the gateway's own
overhead, a replica with a simulated prefix cache so affinity can be measured without a GPU,
a spill-over target and misbehaving replicas. It answers `/v1/chat/completions` and
`/v1/completions`, streaming or not, with `usage`, and can be told to be slow, to hang, to
fail, or to drain.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from servefleet.gateway.asgi import Receive, Scope, Send, respond


@dataclass
class FakeBehaviour:
    """What the fake does; tests mutate it while the server runs."""

    completion_tokens: int = 8
    token_delay_s: float = 0.0
    first_token_delay_s: float = 0.0
    status: int = 200  # answer every completion with this status (e.g. 500, 503)
    ready: bool = True
    hang: bool = False  # accept the request and never answer (until the client leaves)
    die_after_chunks: int | None = None  # a stream's connection is cut after this many tokens
    require_key: str | None = None
    # Simulated prefix cache (for affinity benchmarks): prefill cost per uncached token.
    prefill_s_per_token: float = 0.0
    block_chars: int = 64
    cache_blocks: int = 4096
    # A vLLM prefill replica (P/D, NIXL): the `kv_transfer_params` its whole answers carry.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class FakeStats:
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    active: int = 0
    max_active: int = 0
    prompt_blocks: int = 0
    cached_blocks: int = 0
    disconnects: int = 0  # hung requests whose client (the gateway) went away


class FakeOpenAI:
    """The ASGI app. `record=False` keeps it allocation-light for benchmarks."""

    def __init__(self, behaviour: FakeBehaviour | None = None, *, record: bool = True) -> None:
        self.behaviour = behaviour or FakeBehaviour()
        self.stats = FakeStats()
        self.record = record
        self._cache: OrderedDict[bytes, None] = OrderedDict()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        b = self.behaviour
        if path in ("/ready", "/health"):
            ok = b.ready or path == "/health"
            await _json(send, 200 if ok else 503, {"status": "ok" if ok else "draining"})
            return
        if path == "/metrics":
            body = (
                f"fake_prefix_cache_hit_blocks {self.stats.cached_blocks}\n"
                f"fake_prefix_cache_query_blocks {self.stats.prompt_blocks}\n"
            )
            await _send(send, 200, body.encode(), b"text/plain")
            return
        if path.startswith("/internal/kv/"):  # publishes no KV events (as vLLM): not recorded
            await _json(send, 404, {"error": {"message": "not found", "type": "not_found"}})
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        if b.require_key is not None and headers.get("authorization") != f"Bearer {b.require_key}":
            await _json(send, 401, {"error": {"message": "bad key", "type": "auth", "code": None}})
            return
        body = json.loads(raw or b"{}")
        if self.record:
            self.stats.requests.append(body)
            self.stats.headers.append(headers)
            self.stats.arrivals.append(time.monotonic())
        if b.hang:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.stats.disconnects += 1
            return
        if b.status != 200:
            retry = [(b"retry-after", b"1")] if b.status == 503 else []
            await _send(
                send,
                b.status,
                json.dumps(
                    {"error": {"message": f"fake {b.status}", "type": "x", "code": None}}
                ).encode(),
                headers=retry,
            )
            return
        self.stats.active += 1
        self.stats.max_active = max(self.stats.max_active, self.stats.active)
        try:
            await self._complete(path, body, send)
        finally:
            self.stats.active -= 1

    def _prefill_delay(self, text: str) -> float:
        b = self.behaviour
        if b.prefill_s_per_token <= 0:
            return 0.0
        blocks = len(text) // b.block_chars
        cached = 0
        digest = hashlib.blake2b(digest_size=16)
        hit = True
        for i in range(blocks):
            digest.update(text[i * b.block_chars : (i + 1) * b.block_chars].encode())
            key = digest.copy().digest()
            if hit and key in self._cache:
                cached += 1
                self._cache.move_to_end(key)
            else:
                hit = False
                self._cache[key] = None
                if len(self._cache) > b.cache_blocks:
                    self._cache.popitem(last=False)
        self.stats.prompt_blocks += blocks
        self.stats.cached_blocks += cached
        uncached_tokens = (len(text) - cached * b.block_chars) / 4
        return uncached_tokens * b.prefill_s_per_token

    async def _complete(self, path: str, body: dict[str, Any], send: Send) -> None:
        b = self.behaviour
        chat = path.endswith("/chat/completions")
        model = body.get("model", "fake")
        n = min(int(body.get("max_tokens") or b.completion_tokens), b.completion_tokens)
        if chat:
            text = "".join(str(m.get("content", "")) for m in body.get("messages", []))
        else:
            text = str(body.get("prompt", ""))
        prompt_tokens = max(1, len(text) // 4)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
        }
        delay = b.first_token_delay_s + self._prefill_delay(text)
        if delay:
            await asyncio.sleep(delay)
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            if b.token_delay_s:
                await asyncio.sleep(b.token_delay_s * n)
            if b.die_after_chunks is not None:  # the status line went out, the body never
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b'{"id"', "more_body": True})
                raise ConnectionResetError("fake replica died mid-answer")
            choice: dict[str, Any] = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " tok" * n},
                    "finish_reason": "length",
                }
                if chat
                else {"index": 0, "text": " tok" * n, "finish_reason": "length"}
            )
            await _json(
                send,
                200,
                {
                    "id": "fake-1",
                    "object": obj,
                    "created": 0,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                }
                | ({"kv_transfer_params": b.kv_transfer_params} if b.kv_transfer_params else {}),
            )
            return
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        # Token i is id i, text " tok{i}"; a resumed request (`servefleet.api.stream_resume`)
        # goes on after the ids it was given, as our engine does.
        start = len(body.get("resume_token_ids") or [])
        for sent, i in enumerate(range(start, n)):
            if b.die_after_chunks is not None and sent == b.die_after_chunks:
                raise ConnectionResetError("fake replica died mid-stream")
            if b.token_delay_s:
                await asyncio.sleep(b.token_delay_s)
            if chat:
                delta = {"content": f" tok{i}"}
                choice = {"index": 0, "delta": delta if i else {"role": "assistant", **delta}}
                choice["finish_reason"] = None
            else:
                choice = {"index": 0, "text": f" tok{i}", "finish_reason": None}
            if body.get("return_token_ids"):
                choice["token_ids"] = [i]
            event: dict[str, Any] = {
                "id": "fake-1",
                "object": chunk_obj,
                "created": 0,
                "model": model,
                "choices": [choice],
            }
            if include_usage:
                event["usage"] = None
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + json.dumps(event).encode() + b"\n\n",
                    "more_body": True,
                }
            )
        if include_usage:
            event = {
                "id": "fake-1",
                "object": chunk_obj,
                "created": 0,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + json.dumps(event).encode() + b"\n\n",
                    "more_body": True,
                }
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _send(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await respond(send, status, body, headers=headers, content_type=content_type)


async def _json(send: Send, status: int, obj: Any) -> None:
    await _send(send, status, json.dumps(obj).encode())


def main(argv: list[str] | None = None) -> None:
    """`python -m servefleet.bench.fake_upstream --port P`: an instant upstream (benchmarks)."""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=8, help="completion tokens per answer")
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    behaviour = FakeBehaviour(
        completion_tokens=args.tokens,
        prefill_s_per_token=args.prefill_ms_per_token / 1000,
        token_delay_s=args.token_delay_ms / 1000,
    )
    uvicorn.run(
        FakeOpenAI(behaviour, record=False),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        http="httptools",
        loop="uvloop",
    )


if __name__ == "__main__":
    main()
