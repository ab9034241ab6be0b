"""What became of a request that reached a deployment: one enumeration, read everywhere.

Admission (`servefleet.gateway.admission`) places a request for an outcome (a replica, the
hosted API, or shed) and the pool answers with a placement of that outcome; when the request
ends, `request_outcome` decides its final outcome once, from the placement and the answer.
The gateway counts it under that value (`servefleet_gateway_requests_total{outcome=...}`) and
writes the same value into its access log, which `servefleet sim --trace` replays; the chart's
alert rules and dashboards name these values, and `tests/test_alerts.py` fails on a value that
is not here or an alert that classes one differently from `BURNS_ERROR_BUDGET`/`TENANTS_OWN`.
The values are the metric's label values as first published (hence the status codes).
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    OK = "ok"
    """Answered in full by a replica."""
    SPILLED = "spilled"
    """Answered in full by the hosted API (spill-over)."""
    SHED = "503"
    """Refused for want of capacity, with a Retry-After: shed by admission, or every replica
    busy or draining."""
    LIMITED = "429"
    """Refused by the tenant's limits, before the pool was asked."""
    REJECTED = "4xx"
    """The request's own error (any other 4xx): malformed, too large, refused by the engine."""
    UPSTREAM_ERROR = "upstream_error"
    """A replica or the hosted API failed: a 5xx, a reset, a timeout, a stream cut short."""
    CLIENT_CLOSED = "client_closed"
    """The client left before its answer ended (nginx's 499): no error of ours."""


PLACEMENTS = frozenset({Outcome.OK, Outcome.SPILLED, Outcome.SHED})
"""The outcomes admission places a request for (the pool's `Lease`, `Spill`, `Shed`)."""
BURNS_ERROR_BUDGET = frozenset({Outcome.SHED, Outcome.UPSTREAM_ERROR})
"""Failures of ours: what the error-budget alerts count against availability."""
TENANTS_OWN = frozenset({Outcome.LIMITED, Outcome.REJECTED})
"""The tenant's doing: left out of availability altogether (neither success nor failure)."""

CLIENT_CLOSED_STATUS = 499
"""The status logged for a request whose client left before any answer (nginx's)."""


def request_outcome(
    placed: Outcome | None, status: int | None, *, completed: bool, client_left: bool = False
) -> Outcome:
    """The final outcome of a request: `placed` is what the pool placed it for (None: it never
    reached the pool), `status` the one the client was answered with (None: none was sent),
    `completed` whether the whole answer reached the client."""
    if placed is not None and placed not in PLACEMENTS:
        raise ValueError(f"{placed} is not an outcome a request is placed for")
    if completed and placed in (Outcome.OK, Outcome.SPILLED):
        return placed
    if client_left or status is None or status == CLIENT_CLOSED_STATUS:
        return Outcome.CLIENT_CLOSED
    if placed is Outcome.SHED or status == 503:
        return Outcome.SHED
    if placed is None and status == 429:
        return Outcome.LIMITED
    if 400 <= status < 500:
        return Outcome.REJECTED
    return Outcome.UPSTREAM_ERROR
