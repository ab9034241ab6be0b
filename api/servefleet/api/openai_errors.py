"""OpenAI's error shape, once: the one exception engine and gateway raise, and its body.

`{"error": {"message", "type", "param", "code"}}` is what OpenAI's SDKs parse. Every field is
keyword-only, in the exception and in `error_body` alike: `param` and `code` are both
optional strings, so a positional call could swap them without any checker noticing (two
builders once took them in opposite orders).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

INVALID_REQUEST = "invalid_request_error"


def error_body(
    *, message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The body of an OpenAI error response (or of an SSE error event)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_bytes(
    *, message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> bytes:
    """`error_body` as JSON, for handlers that write bytes themselves."""
    return json.dumps(error_body(message=message, type=type, param=param, code=code)).encode()


class OpenAIError(Exception):
    """A request ended with an OpenAI error: its status, body fields and extra headers
    (`Retry-After`, `Allow`). Raised anywhere in request handling, rendered once per server."""

    def __init__(
        self,
        *,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(message=self.message, type=self.type, param=self.param, code=self.code)

    def body_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()
