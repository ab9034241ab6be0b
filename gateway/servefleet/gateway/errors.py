"""OpenAI-shaped errors: every failure a tenant sees has the same body, so SDKs parse it."""

from __future__ import annotations

import json
from collections.abc import Mapping

from pydantic import ValidationError


class GatewayError(Exception):
    """An error that ends a request with an OpenAI-style body and the given status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": type, "param": param, "code": code}}
    ).encode()


def sse_error_event(message: str, type: str, code: str | None = None) -> bytes:
    """The error event sent when a stream breaks after its status line went out."""
    return b"data: " + error_body(message, type, code) + b"\n\n"


def model_not_found(model: str) -> GatewayError:
    # One answer for "does not exist" and "not yours": a tenant cannot probe for models.
    return GatewayError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def validation_error(exc: ValidationError) -> GatewayError:
    """A 400 naming the first invalid field, the way OpenAI's API answers."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    message = "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
    )
    return GatewayError(400, f"Invalid request: {message}", param=param)


def method_not_allowed(method: str, path: str, allowed: str) -> GatewayError:
    """A known path asked with a method it does not take: 405 and the methods it does."""
    return GatewayError(
        405,
        f"Method {method} is not allowed on {path}; use {allowed}.",
        code="method_not_allowed",
        headers={"allow": allowed},
    )
