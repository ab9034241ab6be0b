"""The one exception every Kubernetes call raises, whatever went wrong underneath."""

from __future__ import annotations


class KubeError(RuntimeError):
    """A failed API call or unusable credentials.

    `status` is the HTTP status of the API server's answer (404, 409, 410 Gone, ...) or 0 when
    there was none (no credentials, connection refused, a broken stream), so callers branch
    on one field instead of on aiohttp's, the generated client's and our own exceptions.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
