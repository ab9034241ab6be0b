"""Whether a freshly started engine still waits to be warmed (`/ready`: 503 kv-warming).

Set when the engine first could be ready; ends at the first of: a warm call finished (or
named no source), or `--kv-warm-start-seconds` passed with no warm call under way. A warm
call under way holds the gate up to its own deadline, so readiness is late by at most the
bound plus one warm's deadline, never forever.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class WarmGate:
    seconds: float  # --kv-warm-start-seconds
    opened_at: float = field(default_factory=time.monotonic)
    pulling_until: float | None = None  # a warm call's deadline while it runs
    done: bool = False

    def warming(self, now: float | None = None) -> bool:
        if self.done:
            return False
        now = time.monotonic() if now is None else now
        if self.pulling_until is not None:
            return now < self.pulling_until
        if now >= self.opened_at + self.seconds:
            self.done = True  # timed out: never warming again
        return not self.done

    def begin(self, deadline_s: float) -> float:
        """A warm call starts: its deadline (monotonic)."""
        self.pulling_until = time.monotonic() + deadline_s
        return self.pulling_until

    def finish(self) -> None:
        self.pulling_until = None
        self.done = True
