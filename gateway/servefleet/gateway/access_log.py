"""The opt-in access log: one `AccessLogLine` (JSON) per completion request, when it ends.

`servefleet gateway --access-log FILE` appends to FILE, `-` writes to stdout (the pod's log);
`servefleet sim --trace FILE` replays what was written. A request gets its line once it has a
deployment (tenant and model known); one refused before that (no key, bad JSON, unknown model)
has nothing to replay and is only counted in the metrics. A line is built from the route's
tenant name and the request's counts and times — never from its headers or body — so no key
can reach the log. Lines are written and flushed one at a time: a few hundred bytes per
request, so a crash loses at most the request in progress.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from servefleet.api.access_log import AccessLogLine
from servefleet.api.outcomes import Outcome
from servefleet.gateway.call import Call
from servefleet.gateway.pool_types import Lease, Shed, Spill
from servefleet.gateway.queueing import TrafficClass


class AccessLog:
    """Writes lines to a text stream; `clock` must be the one `Call.started` was read from."""

    def __init__(
        self,
        stream: TextIO,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        owns_stream: bool = False,
    ) -> None:
        self._stream = stream
        self._clock = clock
        self._wall_clock = wall_clock
        self._owns_stream = owns_stream

    @classmethod
    def open(cls, target: str, *, clock: Callable[[], float] = time.monotonic) -> AccessLog:
        """`-` is stdout; anything else a file, appended to (a restart keeps the history)."""
        if target == "-":
            return cls(sys.stdout, clock=clock)
        return cls(open(target, "a", encoding="utf-8"), clock=clock, owns_stream=True)

    def line(self, call: Call, status: int, outcome: Outcome) -> AccessLogLine:
        now = self._clock()
        placement = call.placement
        used = call.used
        return AccessLogLine(
            ts=self._wall_clock() - (now - call.started),
            deployment=call.route.pool.name,
            model=call.route.pool.model,
            adapter=call.route.adapter.name if call.route.adapter is not None else None,
            tenant=call.route.tenant,
            traffic_class="batch"
            if call.route.traffic_class is TrafficClass.BATCH
            else "interactive",
            outcome=outcome,
            prompt_tokens=used.prompt_tokens if used is not None else call.prompt_tokens,
            completion_tokens=used.completion_tokens if used is not None else 0,
            queue_wait_s=placement.queue_wait_s if isinstance(placement, Lease) else 0.0,
            ttft_s=call.ttft_s,
            duration_s=max(0.0, now - call.started),
            status=status,
            replica=call.replica,
            reason=placement.reason if isinstance(placement, Spill | Shed) else None,
        )

    def write(self, line: AccessLogLine) -> None:
        self._stream.write(line.model_dump_json(exclude_none=True) + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._owns_stream:
            self._stream.close()
