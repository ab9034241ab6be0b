"""The one error a download raises, and whether trying again can help."""

from __future__ import annotations


class FetchError(Exception):
    """A download failed. `permanent` when the same request will fail again (not found,
    no access): those are retried only slowly, since a person has to fix something."""

    def __init__(self, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.message = message
        self.permanent = permanent


PERMANENT_HTTP_STATUSES = frozenset({400, 401, 403, 404, 410})


def http_error(status: int, what: str) -> FetchError:
    """A FetchError for an HTTP status, with a hint for the statuses a person can fix."""
    hints = {
        401: " (missing or wrong credentials: check the Secret)",
        403: " (access denied: check the credentials and their permissions)",
        404: " (not found: check the name, path and revision)",
    }
    return FetchError(
        f"HTTP {status} for {what}{hints.get(status, '')}",
        permanent=status in PERMANENT_HTTP_STATUSES,
    )
