"""Restart pacing for engines that keep crashing, and the lines that say why.

kubelet's CrashLoopBackOff, on one machine: the first crash is replaced at once, each further
one in a row waits twice as long (capped), and a replica that served for a while resets the
count. Without it a broken engine (a bad model path, a port race, an out-of-memory load) is
restarted every few seconds forever, with the reason only in a log file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass
class CrashBackoff:
    base_s: float = 1.0
    cap_s: float = 60.0
    reset_after_s: float = 60.0  # ready this long before the crash: counted as the first
    crashes: int = 0
    not_before: float = 0.0

    def crashed(self, now: float, ready_for_s: float | None) -> float:
        """Record a crash at `now`; returns the delay before the next start."""
        if ready_for_s is not None and ready_for_s >= self.reset_after_s:
            self.crashes = 0
        self.crashes += 1
        delay = 0.0 if self.crashes == 1 else min(self.cap_s, self.base_s * 2 ** (self.crashes - 2))
        self.not_before = now + delay
        return delay

    def may_start(self, now: float) -> bool:
        return now >= self.not_before


def last_lines(path: Path, count: int = 8, max_bytes: int = 16384) -> list[str]:
    """The last `count` non-blank lines of a log file (read from its end; never raises)."""
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - max_bytes))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return []
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return lines[-count:]
