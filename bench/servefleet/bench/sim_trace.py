"""Request traces for the autoscaler simulator, and the seeded diurnal one with spikes.

A `Trace` is what any source reduces to: arrival times, the seconds each request holds a slot,
its tokens (what spill-over is billed by) and its traffic class. `sim_bursty` and
`sim_access_log` build the other two kinds.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

TOKENS_PER_SECOND_OF_SERVICE = 33.0
"""Output tokens one request gets per second of slot time (about 30 ms per token)."""
PROMPT_TOKENS_MEAN = 400.0


class TraceSpec(BaseModel):
    """Shape of the offered load. One "day" is compressed into `duration_s`."""

    model_config = ConfigDict(frozen=True)

    duration_s: float = Field(default=6 * 3600.0, gt=0)
    peak_rate: float = Field(default=8.0, gt=0, description="requests/s at the diurnal peak")
    trough_share: float = Field(default=0.2, ge=0, le=1, description="trough rate / peak rate")
    spikes: int = Field(default=8, ge=0, description="bursts laid on top of the curve")
    spike_multiplier: tuple[float, float] = (1.5, 2.5)
    spike_duration_s: tuple[float, float] = (60.0, 300.0)
    spike_ramp_s: float = Field(default=30.0, ge=0, description="rise time of each burst")
    mean_service_s: float = Field(default=6.0, gt=0, description="time one request holds a slot")
    service_sigma: float = Field(default=0.5, ge=0, description="lognormal spread of service")
    batch_share: float = Field(default=0.0, ge=0, le=1, description="share of batch requests")
    seed: int = 7


class Spike(BaseModel):
    model_config = ConfigDict(frozen=True)

    start_s: float
    duration_s: float
    multiplier: float


class Trace(BaseModel):
    """Requests sorted by arrival: when, how long they hold a slot, tokens, batch or not."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    name: str
    duration_s: float
    arrivals_s: np.ndarray
    service_s: np.ndarray
    tokens: np.ndarray
    batch: np.ndarray
    spec: TraceSpec | None = None
    spikes: tuple[Spike, ...] = ()

    @property
    def mean_service_s(self) -> float:
        return float(self.service_s.mean()) if self.service_s.size else 1.0

    def arrival_cv(self) -> float:
        """Coefficient of variation of inter-arrival times (1 for Poisson)."""
        gaps = np.diff(self.arrivals_s)
        return float(gaps.std() / gaps.mean()) if gaps.size > 1 and gaps.mean() > 0 else 0.0


def diurnal_rate(spec: TraceSpec, t: float) -> float:
    """Smooth day curve: trough at both ends, peak in the middle."""
    day = 0.5 * (1 - math.cos(2 * math.pi * t / spec.duration_s))
    return spec.peak_rate * (spec.trough_share + (1 - spec.trough_share) * day)


def rate_at(spec: TraceSpec, spikes: tuple[Spike, ...], t: float) -> float:
    """Offered arrival rate at `t`: the day curve times every burst active then."""
    rate = diurnal_rate(spec, t)
    for spike in spikes:
        into = t - spike.start_s
        if 0 <= into <= spike.duration_s:
            rise = min(1.0, into / spec.spike_ramp_s) if spec.spike_ramp_s > 0 else 1.0
            rate *= 1 + (spike.multiplier - 1) * rise
    return rate


def tokens_for(service_s: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Prompt + completion tokens of requests holding a slot this long (spill is billed so)."""
    prompt = rng.exponential(PROMPT_TOKENS_MEAN, size=service_s.size)
    return np.round(prompt + service_s * TOKENS_PER_SECOND_OF_SERVICE).astype(np.int64)


def make_trace(spec: TraceSpec) -> Trace:
    """Non-homogeneous Poisson arrivals (per-second counts, uniform within the second)."""
    rng = np.random.default_rng(spec.seed)
    spikes = tuple(
        Spike(
            start_s=float(rng.uniform(0.05, 0.9) * spec.duration_s),
            duration_s=float(rng.uniform(*spec.spike_duration_s)),
            multiplier=float(rng.uniform(*spec.spike_multiplier)),
        )
        for _ in range(spec.spikes)
    )
    seconds = int(spec.duration_s)
    rates = np.array([rate_at(spec, spikes, s + 0.5) for s in range(seconds)])
    counts = rng.poisson(rates)
    starts = np.repeat(np.arange(seconds, dtype=float), counts)
    arrivals = np.sort(starts + rng.uniform(0.0, 1.0, size=starts.size))
    mu = math.log(spec.mean_service_s) - spec.service_sigma**2 / 2
    service = rng.lognormal(mu, spec.service_sigma, size=arrivals.size)
    return Trace(
        name="diurnal",
        duration_s=spec.duration_s,
        arrivals_s=arrivals,
        service_s=service,
        tokens=tokens_for(service, rng),
        batch=rng.uniform(size=arrivals.size) < spec.batch_share,
        spec=spec,
        spikes=spikes,
    )
