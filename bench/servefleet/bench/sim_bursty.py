"""A bursty trace: arrivals far from Poisson, prompt and output lengths heavy-tailed.

Arrivals come from a two-state Markov-modulated process (quiet minutes, then bursts several
times as busy, each state lasting an exponential time) with gamma-clustered gaps inside a
state, so the inter-arrival coefficient of variation is well above 1 both within seconds and
over minutes. Lengths are lognormal (outputs) and Pareto (prompts), capped like a real
context window: most requests are short, a few hold a slot for minutes.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .sim_trace import TOKENS_PER_SECOND_OF_SERVICE, Trace

PREFILL_SECONDS_PER_TOKEN = 0.0002


class BurstySpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    duration_s: float = Field(default=6 * 3600.0, gt=0)
    quiet_rate: float = Field(default=2.0, gt=0, description="requests/s between bursts")
    burst_rate: float = Field(default=12.0, gt=0, description="requests/s inside a burst")
    quiet_mean_s: float = Field(default=600.0, gt=0)
    burst_mean_s: float = Field(default=90.0, gt=0)
    gap_shape: float = Field(default=0.2, gt=0, description="gamma shape of gaps (1 = Poisson)")
    output_median: float = Field(default=120.0, gt=0, description="output tokens, median")
    output_sigma: float = Field(default=1.1, ge=0)
    prompt_min: float = Field(default=150.0, gt=0)
    prompt_alpha: float = Field(default=1.4, gt=1, description="Pareto tail of prompt tokens")
    max_tokens: int = Field(default=8192, gt=0)
    batch_share: float = Field(default=0.15, ge=0, le=1)
    seed: int = 11


def _arrivals(spec: BurstySpec, rng: np.random.Generator) -> np.ndarray:
    """Gamma-gapped arrivals whose rate switches between quiet and burst states."""
    out: list[np.ndarray] = []
    t, bursting = 0.0, False
    while t < spec.duration_s:
        length = rng.exponential(spec.burst_mean_s if bursting else spec.quiet_mean_s)
        end = min(t + length, spec.duration_s)
        rate = spec.burst_rate if bursting else spec.quiet_rate
        expected = int((end - t) * rate * 1.5) + 16
        gaps = rng.gamma(spec.gap_shape, 1.0 / (rate * spec.gap_shape), size=expected)
        times = t + np.cumsum(gaps)
        out.append(times[times < end])
        t, bursting = end, not bursting
    return np.concatenate(out) if out else np.zeros(0)


def make_bursty_trace(spec: BurstySpec) -> Trace:
    rng = np.random.default_rng(spec.seed)
    arrivals = _arrivals(spec, rng)
    n = arrivals.size
    output = np.minimum(
        rng.lognormal(np.log(spec.output_median), spec.output_sigma, size=n), spec.max_tokens
    )
    prompt = np.minimum(spec.prompt_min * (1 + rng.pareto(spec.prompt_alpha, size=n)), 16384)
    service = output / TOKENS_PER_SECOND_OF_SERVICE + prompt * PREFILL_SECONDS_PER_TOKEN
    return Trace(
        name="bursty",
        duration_s=spec.duration_s,
        arrivals_s=arrivals,
        service_s=service,
        tokens=np.round(output + prompt).astype(np.int64),
        batch=rng.uniform(size=n) < spec.batch_share,
    )
