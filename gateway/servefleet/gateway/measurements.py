"""What a pool learns from its own traffic: recent latencies and rates (request duration and
cold start are `api.ewma.Ewma`s).

Admission predicts waits from these, and the autoscaler reads them through the pool's stats,
so they are measured where the requests pass rather than configured.
"""

from __future__ import annotations

import math
from collections import deque


class LatencyWindow:
    """Recent latencies (queue wait, TTFT) for a percentile the autoscaler can act on.

    A time window, not a histogram since start: the autoscaler needs what users see now.
    """

    def __init__(self, window_s: float = 60.0, max_samples: int = 4096) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, now: float, seconds: float) -> None:
        self._samples.append((now, seconds))

    def percentile(self, now: float, q: float) -> float | None:
        """The q-quantile (nearest rank) of the samples in the window; None without any."""
        samples = self._samples
        while samples and samples[0][0] < now - self.window_s:
            samples.popleft()
        if not samples:
            return None
        ordered = sorted(v for _, v in samples)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class RateWindow:
    """Events (or an amount carried by each, e.g. tokens) per second over the last window."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, float]] = deque()

    def add(self, now: float, amount: float = 1.0) -> None:
        self._events.append((now, amount))

    def per_second(self, now: float) -> float:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        return sum(amount for _, amount in self._events) / self.window_s
