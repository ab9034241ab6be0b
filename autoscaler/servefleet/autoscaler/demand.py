"""Demand as the policy sizes by: interactive requests now, their recent level, its trend.

Pure arithmetic over an `Observation` and a short history of samples, kept apart from the
rules in `policy` so each can be read on its own. In-flight counts of a steady load are
Poisson-like, so "noise" is measured in square roots of the level.
"""

from __future__ import annotations

import math

from .signals import Observation, ReplicaState

History = tuple[tuple[float, float], ...]
"""(time, demand) samples over the last `TREND_WINDOW_S`."""

TREND_WINDOW_S = 60.0
"""Demand history used for the level and the trend; long enough to average out Poisson noise."""
MIN_TREND_SAMPLES = 4
TREND_SIGNIFICANCE = 3.0
"""Standard errors taken off the fitted slope before it is believed."""
BURST_SIGMAS = 4.0
"""A sample this many Poisson deviations above the recent level, with requests waiting, is a
burst to size for at once; anything less is noise the level absorbs."""
HOLD_SIGMAS = 1.5
"""Scale-down keeps this many Poisson deviations of headroom above the level (about four
standard errors of a one-minute mean), so a pool just shrunk is not outgrown again by the
same load's noise: the difference between a hold and an up-down-up."""


def interactive_demand(observation: Observation, count_spilled: bool) -> float:
    """Interactive requests that need a slot now: queued plus in flight.

    Batch requests, queued or running, may wait, so they buy nothing by themselves (counted,
    a running backlog would buy replicas that only let more of it run). Spilled requests count
    (as the slots they would hold, by Little's law) only once buying is cheaper than renting.
    """
    batch = observation.gateway_queued_batch + observation.in_flight_batch
    demand = float(max(0, observation.demand - batch))
    if count_spilled and observation.mean_service_s is not None:
        demand += observation.spilled_per_s * observation.mean_service_s
    return demand


def waiting(observation: Observation) -> int:
    """Interactive requests waiting for a slot: only these are served sooner by more replicas."""
    in_engines = sum(
        r.waiting for r in observation.replicas if r.state is not ReplicaState.DRAINING
    )
    return observation.gateway_queued - observation.gateway_queued_batch + in_engines


def level_window_s(scale_down_delay_s: float) -> float:
    """The level averages over a minute, never longer than demand must stay low to shrink:
    a deployment that asks to scale down after 1 s is not held up by a minute of history."""
    return min(TREND_WINDOW_S, scale_down_delay_s)


def append_history(history: History, now: float, demand: float, window_s: float) -> History:
    kept = tuple((t, d) for t, d in history if now - t <= window_s and t < now)
    return (*kept, (now, demand))


def window(history: History, now: float, window_s: float) -> History:
    return tuple((t, d) for t, d in history if now - t <= window_s)


def mean_level(history: History) -> float:
    return sum(d for _, d in history) / len(history) if history else 0.0


def is_burst(sample: float, level: float) -> bool:
    return sample > level + BURST_SIGMAS * math.sqrt(max(level, 1.0))


def noise_margin(level: float) -> float:
    return HOLD_SIGMAS * math.sqrt(max(level, 0.0))


def with_headroom(level: float) -> float:
    return level + noise_margin(level)


def fitted_now(history: History, slope: float) -> float:
    """The trend line's value at the newest sample: today's demand with the noise averaged out."""
    if not history:
        return 0.0
    mean_t = sum(t for t, _ in history) / len(history)
    return mean_level(history) + slope * (history[-1][0] - mean_t)


def demand_trend(history: History) -> float:
    """How fast demand is surely rising, in requests per second: the least-squares slope over
    the window less `TREND_SIGNIFICANCE` standard errors, or 0.

    The lower bound rather than the slope itself, because successive in-flight counts are
    correlated (a request spans several samples), so a flat load's noise passes a plain
    significance test a few times an hour; a real ramp keeps most of its slope.
    """
    n = len(history)
    if n < MIN_TREND_SAMPLES:
        return 0.0
    mean_t = sum(t for t, _ in history) / n
    mean_d = sum(d for _, d in history) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in history)
    if var_t == 0:
        return 0.0
    slope = sum((t - mean_t) * (d - mean_d) for t, d in history) / var_t
    residual = sum((d - mean_d - slope * (t - mean_t)) ** 2 for t, d in history)
    stderr = math.sqrt(residual / (n - 2) / var_t)
    return max(0.0, slope - TREND_SIGNIFICANCE * stderr)
