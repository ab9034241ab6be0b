"""Bytes to a validated OpenAI request, with the same bounds and errors in engine and gateway.

Hostile bodies are stopped before the JSON parser sees them: a body over `MAX_BODY_BYTES` is a
413 and one nested deeper than `MAX_JSON_DEPTH` a 400 (the parser would otherwise recurse
until it fails with a 500); after it, a string with an unpaired UTF-16 surrogate escape is a
400 (Python's parser keeps it, and tokenizers fail on it). Request headers over
`MAX_HEADER_BYTES` are a 431 (`HeaderLimit`).
Every refusal is an `OpenAIError` (`servefleet.api.openai_errors`) naming the offending
parameter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Sequence
from itertools import accumulate, count
from operator import sub
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from servefleet.api.openai_errors import OpenAIError, error_bytes

MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_JSON_DEPTH = 64
MAX_HEADER_BYTES = 32 * 1024

ModelT = TypeVar("ModelT", bound=BaseModel)

_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_STEP = bytes.maketrans(b"[]{}", b"\x02\x00\x02\x00")
_CHUNK = 1 << 16
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# A `\uD800`-`\uDFFF` escape: only bodies holding one are checked for an unpaired surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_depth_exceeds(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when arrays/objects nest deeper than `limit` (brackets inside strings do not count).

    Linear and in C: strings are blanked, everything but brackets dropped, and the running
    depth is a prefix sum (an opener counts 2, a closer 0, minus one per bracket).
    """
    if len(raw.translate(None, _NOT_BRACKETS)) <= 2 * limit:  # most bodies: too few to nest
        return False
    brackets = _JSON_STRING.sub(b'""', raw).translate(None, _NOT_BRACKETS)
    steps = brackets.translate(_STEP)
    depth = 0
    for start in range(0, len(steps), _CHUNK):  # in chunks, so a deep prefix stops early
        chunk = steps[start : start + _CHUNK]
        if depth + max(map(sub, accumulate(chunk, initial=0), count())) > limit:
            return True
        depth += 2 * chunk.count(2) - len(chunk)
    return False


def parse_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, bounded in size and depth before it is parsed."""
    if len(raw) > MAX_BODY_BYTES:
        raise OpenAIError(
            status=413,
            message=f"The request body is larger than {MAX_BODY_BYTES} bytes.",
            code="request_too_large",
        )
    if json_depth_exceeds(raw):
        raise OpenAIError(
            status=400,
            message=f"The request body nests JSON deeper than {MAX_JSON_DEPTH} levels.",
            code="json_too_deep",
        )
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        message = f"We could not parse the JSON body of your request: {exc}"
        raise OpenAIError(status=400, message=message) from None
    if not isinstance(data, dict):
        raise OpenAIError(status=400, message="The request body must be a JSON object.")
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise OpenAIError(
            status=400,
            message="The request body holds a lone UTF-16 surrogate escape (\\uD800-\\uDFFF), "
            "which is not a Unicode character.",
            code="invalid_unicode",
        )
    return data


def _has_lone_surrogate(data: dict[str, Any]) -> bool:
    """True when a string (or key) holds a surrogate JSON paired with nothing: Python's parser
    keeps it, and it would fail later, in a tokenizer or an encode (a 500, not a 400)."""
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


def describe(exc: ValidationError) -> tuple[str, str | None]:
    """(message, param) for a validation error: unknown fields first, each named."""
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    parts: list[str] = []
    for error in errors[:5]:
        loc = ".".join(str(p) for p in error["loc"]) or "body"
        if error["type"] == "extra_forbidden":
            parts.append(f"Unrecognized request argument supplied: {loc}")
        else:
            parts.append(f"{loc}: {error['msg']}")
    return "; ".join(parts) or "Invalid request.", _param(errors)


def _param(errors: list[Any]) -> str | None:
    """The first error's location; where a union's branches all failed, the field itself
    (pydantic adds each branch's name to the location: `priority.int`)."""
    if not errors:
        return None
    loc = tuple(errors[0]["loc"])
    branches = [tuple(e["loc"]) for e in errors if tuple(e["loc"])[: len(loc) - 1] == loc[:-1]]
    if len(loc) > 1 and len(branches) > 1:
        common = 0
        while all(len(b) > common and b[common] == loc[common] for b in branches):
            common += 1
        loc = loc[:common]
    return ".".join(str(p) for p in loc) or None


def validate(model: type[ModelT], data: dict[str, Any]) -> ModelT:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = describe(exc)
        raise OpenAIError(status=400, message=message, param=param) from None


def parse_request(model: type[ModelT], raw: bytes) -> tuple[dict[str, Any], ModelT]:
    """(the parsed body, the validated request): the one way a body becomes a request."""
    data = parse_object(raw)
    return data, validate(model, data)


# ---- request headers -------------------------------------------------------------------------
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def headers_too_large(scope: Scope, limit: int = MAX_HEADER_BYTES) -> bool:
    return sum(len(k) + len(v) for k, v in scope.get("headers", ())) > limit


async def send_json(
    send: Send, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """A whole JSON response from plain ASGI: the one way our middlewares refuse a request
    before any framework sees it (`headers` go after content-type and content-length)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_header_error(send: Send) -> None:
    message = f"Request headers are larger than {MAX_HEADER_BYTES} bytes."
    body = error_bytes(message=message, code="request_header_fields_too_large")
    await send_json(send, 431, body, [(b"connection", b"close")])


class HeaderLimit:
    """ASGI wrapper answering 431 to a request whose headers exceed `MAX_HEADER_BYTES`.

    The HTTP server we run (uvicorn with httptools) has no header limit of its own.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and headers_too_large(scope):
            await send_header_error(send)
            return
        await self.app(scope, receive, send)
