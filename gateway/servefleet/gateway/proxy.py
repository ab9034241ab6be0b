"""Relaying a response from an engine or the hosted API, and learning its token usage.

Bodies pass through unchanged, with one exception: a streaming request is always sent upstream
with `stream_options.include_usage`, so the gateway can settle the exact completion tokens; if
the client did not ask for usage, that one extra chunk is dropped on the way back. Events are
split on SSE boundaries so a chunk is never forwarded half-written, and only the (rare) events
that carry a usage object are parsed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from servefleet.gateway.stream_splice import StreamSplice

_USAGE_NULL = re.compile(rb'"usage"\s*:\s*null')


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


def usage_from_json(body: bytes) -> Usage | None:
    """Usage of a non-streaming response, or None when it has none."""
    if b'"usage"' not in body:
        return None
    try:
        usage = json.loads(body).get("usage")
    except (ValueError, AttributeError):
        return None
    return _usage(usage)


def _usage(usage: Any) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    return Usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))


class SseRelay:
    """Splits an upstream SSE byte stream into whole events and notes usage as it passes."""

    __slots__ = ("_buffer", "_splice", "_strip_usage", "done", "events", "usage")

    def __init__(self, *, strip_usage: bool, splice: StreamSplice | None = None) -> None:
        self._buffer = b""
        self._strip_usage = strip_usage
        self._splice = splice  # a resumable stream: every event is rewritten (`stream_splice`)
        self.usage: Usage | None = None
        self.events = 0  # data events seen (a stand-in for tokens when usage never comes)
        self.done = False

    def feed(self, chunk: bytes) -> bytes:
        """Bytes of whole events to forward now (possibly empty)."""
        data = self._buffer + chunk if self._buffer else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._buffer = data
            return b""
        ready, self._buffer = data[: cut + 2], data[cut + 2 :]
        if self._splice is None and b'"usage"' not in ready and b"[DONE]" not in ready:
            self.events += ready.count(b"data:")
            return ready
        kept: list[bytes] = []
        for event in ready.split(b"\n\n")[:-1]:
            out = self._keep(event)
            if out is not None:
                kept.append(out + b"\n\n")
        return b"".join(kept)

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest

    def restart(self) -> None:
        """A continuation follows: a half-received event of the broken replica is dropped."""
        self._buffer = b""

    def _keep(self, event: bytes) -> bytes | None:
        """The event to forward (rewritten for a spliced stream), or None to drop it."""
        if b"[DONE]" in event:
            self.done = True
            return event
        if self._splice is not None:
            event = self._spliced(event, self._splice)
            if not event:
                return None
        return event if self._keep_plain(event) else None

    @staticmethod
    def _spliced(event: bytes, splice: StreamSplice) -> bytes:
        try:
            obj = json.loads(event.split(b"data:", 1)[-1])
        except ValueError:
            return event
        if not isinstance(obj, dict):
            return event
        rewritten = splice.rewrite(obj)
        if rewritten is None:
            return b""
        return b"data: " + json.dumps(rewritten, separators=(",", ":")).encode()

    def _keep_plain(self, event: bytes) -> bool:
        self.events += 1
        if b'"usage"' not in event or _USAGE_NULL.search(event):
            return True
        payload = event.split(b"data:", 1)[-1].strip()
        try:
            obj = json.loads(payload)
        except ValueError:
            return True
        usage = _usage(obj.get("usage")) if isinstance(obj, dict) else None
        if usage is None:
            return True
        self.usage = usage
        self.events -= 1
        # The usage-only chunk we asked for on the client's behalf: not theirs to see.
        return not (self._strip_usage and not obj.get("choices"))


def prepare_body(
    raw: bytes,
    parsed: dict[str, Any],
    *,
    stream: bool,
    client_wants_usage: bool,
    model: str | None = None,
    extra: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
) -> bytes:
    """The body to send upstream: unchanged unless usage must be asked for, the model renamed,
    the gateway adds fields of its own (`extra`: the engine priority) or `drop`s some."""
    dropped = [name for name in drop if name in parsed]
    if model is None and not extra and not dropped and (not stream or client_wants_usage):
        return raw
    body = {k: v for k, v in parsed.items() if k not in dropped}
    body.update(extra or {})
    if model is not None:
        body["model"] = model
    if stream and not client_wants_usage:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream_options"] = options
    return json.dumps(body, separators=(",", ":")).encode()


def upstream_error_message(status: int, body: bytes) -> str:
    """The upstream's own error message when it sent an OpenAI-style one."""
    try:
        obj = json.loads(body)
        message = obj["error"]["message"]
        if isinstance(message, str):
            return message
    except (ValueError, KeyError, TypeError):
        pass
    text = body[:200].decode(errors="replace").strip()
    return f"upstream answered {status}" + (f": {text}" if text else "")
