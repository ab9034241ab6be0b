"""An exponentially weighted moving average: what a component learns from its own traffic
(the gateway's request duration and cold start, an engine's prompt rate and pull bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Ewma:
    value: float
    alpha: float = 0.2
    samples: int = 0

    def update(self, sample: float) -> None:
        # The first real measurement replaces the configured prior outright.
        self.value = (
            sample if self.samples == 0 else self.value + self.alpha * (sample - self.value)
        )
        self.samples += 1
