"""The gateway's common OpenAI errors (`servefleet.api.openai_errors` is the type and body):
every failure a tenant sees has the same shape, so SDKs parse it."""

from __future__ import annotations

from pydantic import ValidationError

from servefleet.api.openai_errors import OpenAIError, error_bytes


def sse_error_event(message: str, type: str, code: str | None = None) -> bytes:
    """The error event sent when a stream breaks after its status line went out."""
    return b"data: " + error_bytes(message=message, type=type, code=code) + b"\n\n"


def model_not_found(model: str) -> OpenAIError:
    # One answer for "does not exist" and "not yours": a tenant cannot probe for models.
    return OpenAIError(
        status=404,
        message=f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def validation_error(exc: ValidationError) -> OpenAIError:
    """A 400 naming the first invalid field, the way OpenAI's API answers."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    message = "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
    )
    return OpenAIError(status=400, message=f"Invalid request: {message}", param=param)


def method_not_allowed(method: str, path: str, allowed: str) -> OpenAIError:
    """A known path asked with a method it does not take: 405 and the methods it does."""
    return OpenAIError(
        status=405,
        message=f"Method {method} is not allowed on {path}; use {allowed}.",
        code="method_not_allowed",
        headers={"allow": allowed},
    )
