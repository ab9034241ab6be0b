"""The response headers that tell a client its limits: OpenAI's `x-ratelimit-*` and Retry-After."""

from __future__ import annotations

import math

from servefleet.gateway.asgi import Headers
from servefleet.gateway.limits import LimitSnapshot


def format_reset(seconds: float) -> str:
    """OpenAI's duration style: 20ms, 1.5s, 6m0s."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{int(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    if minutes:
        return f"{int(minutes)}m{int(rest)}s"
    return f"{rest:.3f}".rstrip("0").rstrip(".") + "s"


def ratelimit_headers(snapshot: LimitSnapshot) -> Headers:
    headers: Headers = []
    if snapshot.limit_requests is not None:
        headers += [
            (b"x-ratelimit-limit-requests", str(snapshot.limit_requests).encode()),
            (b"x-ratelimit-remaining-requests", str(snapshot.remaining_requests).encode()),
            (b"x-ratelimit-reset-requests", format_reset(snapshot.reset_requests_s).encode()),
        ]
    if snapshot.limit_tokens is not None:
        headers += [
            (b"x-ratelimit-limit-tokens", str(snapshot.limit_tokens).encode()),
            (b"x-ratelimit-remaining-tokens", str(snapshot.remaining_tokens).encode()),
            (b"x-ratelimit-reset-tokens", format_reset(snapshot.reset_tokens_s).encode()),
        ]
    return headers


def retry_after(seconds: float) -> str:
    """Whole seconds, at least 1: clients treat 0 as "now"."""
    return str(max(1, math.ceil(seconds)))


def retry_headers(seconds: float) -> Headers:
    return [
        (b"retry-after", retry_after(seconds).encode()),
        (b"retry-after-ms", str(max(1, int(seconds * 1000))).encode()),
    ]
