"""A call's outcome, decided once when it ends: counted in the metrics, written to the log.

Every module on the path only notes what happened on the `Call` (where the pool placed it,
whether the whole answer went out, whether the client left) and the status the client was
answered with is recorded on the way out; `servefleet.api.outcomes.request_outcome` turns
that into one `Outcome`, so the `outcome` label of `servefleet_gateway_requests_total` and the
access log's `outcome` cannot disagree, and a request is counted exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from servefleet.api.openai_errors import OpenAIError
from servefleet.api.outcomes import CLIENT_CLOSED_STATUS, Outcome, request_outcome
from servefleet.gateway.access_log import AccessLog
from servefleet.gateway.asgi import Send, StatusRecorder
from servefleet.gateway.call import Call
from servefleet.gateway.pool_types import Spill

INTERNAL_ERROR_STATUS = 500
"""What the app answers a bug with (after this block)."""


def call_outcome(call: Call, status: int | None) -> Outcome:
    """The outcome of `call`, answered with `status` (None: no answer was started)."""
    placed = call.placement.outcome if call.placement is not None else None
    return request_outcome(placed, status, completed=call.completed, client_left=call.client_left)


@contextlib.contextmanager
def recorded(call: Call, send: Send, log: AccessLog | None) -> Iterator[Send]:
    """Yields the `send` to answer with; when the block is left, counts the call's outcome
    (and, when it completed, its tokens) and writes its access-log line."""
    recorder = StatusRecorder(send)
    status: int | None = None
    try:
        yield recorder.send
    except OpenAIError as exc:  # answered by the app, after this block
        status = exc.status
        raise
    except asyncio.CancelledError:  # the client went away: no answer
        raise
    except Exception:
        status = INTERNAL_ERROR_STATUS
        raise
    finally:
        status = recorder.status or status
        outcome = call_outcome(call, status)
        metrics = call.route.metrics
        metrics.outcome[outcome].inc()
        if call.completed and call.used is not None:
            metrics.prompt_tokens.inc(call.used.prompt_tokens)
            metrics.completion_tokens.inc(call.used.completion_tokens)
            if isinstance(call.placement, Spill):
                metrics.spilled_prompt_tokens.inc(call.used.prompt_tokens)
                metrics.spilled_completion_tokens.inc(call.used.completion_tokens)
        if log is not None:
            log.write(log.line(call, status or CLIENT_CLOSED_STATUS, outcome))
