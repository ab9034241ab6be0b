"""Synthetic, seeded request traces for the autoscaler simulator: a diurnal curve with spikes."""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


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
    seed: int = 7


class Spike(BaseModel):
    model_config = ConfigDict(frozen=True)

    start_s: float
    duration_s: float
    multiplier: float


class Trace(BaseModel):
    """Arrival times and service times, sorted by arrival."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    spec: TraceSpec
    spikes: tuple[Spike, ...]
    arrivals_s: np.ndarray
    service_s: np.ndarray


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
    return Trace(spec=spec, spikes=spikes, arrivals_s=arrivals, service_s=service)
