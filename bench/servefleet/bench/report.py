"""Turns per-request observations into the one JSON summary a benchmark prints."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from servefleet.bench.client import RequestResult

MAX_ERRORS_KEPT = 5


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method), q in [0, 100]."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Distribution(BaseModel):
    """Milliseconds; `null` in JSON when no request produced a sample."""

    mean: float | None
    p50: float | None
    p99: float | None
    count: int

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(mean=None, p50=None, p99=None, count=0)
        ms = [v * 1000.0 for v in values]
        return cls(
            mean=sum(ms) / len(ms),
            p50=percentile(ms, 50),
            p99=percentile(ms, 99),
            count=len(ms),
        )


class BenchSummary(BaseModel):
    parameters: dict[str, Any]
    completed: int
    failed: int
    errors: list[str]
    duration_s: float
    request_throughput_rps: float
    output_token_throughput_tps: float
    total_token_throughput_tps: float
    total_input_tokens: int
    total_output_tokens: int
    mean_input_tokens: float
    mean_output_tokens: float
    output_tokens_source: str
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_latency_ms: Distribution


def summarize(
    results: Sequence[RequestResult], duration_s: float, parameters: dict[str, Any]
) -> BenchSummary:
    """Figures cover completed requests only; failures are counted and their first errors kept.

    Throughputs divide by the wall time of the whole measured phase, so failures still cost
    time, as they do for a real client.
    """
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    total_in = sum(r.input_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    with_usage = sum(1 for r in ok if r.usage_completion_tokens is not None)
    if not ok:
        source = "none"
    elif with_usage == len(ok):
        source = "usage"
    else:
        source = "chunks" if with_usage == 0 else "mixed"
    seen: list[str] = []
    for r in failed:
        if r.error is not None and r.error not in seen and len(seen) < MAX_ERRORS_KEPT:
            seen.append(r.error)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return BenchSummary(
        parameters=parameters,
        completed=len(ok),
        failed=len(failed),
        errors=seen,
        duration_s=duration_s,
        request_throughput_rps=per_s(len(ok)),
        output_token_throughput_tps=per_s(total_out),
        total_token_throughput_tps=per_s(total_in + total_out),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        mean_input_tokens=total_in / len(ok) if ok else 0.0,
        mean_output_tokens=total_out / len(ok) if ok else 0.0,
        output_tokens_source=source,
        ttft_ms=Distribution.of_seconds([t for r in ok if (t := r.ttft) is not None]),
        tpot_ms=Distribution.of_seconds([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=Distribution.of_seconds([x for r in ok for x in r.itls]),
        e2e_latency_ms=Distribution.of_seconds([r.latency for r in ok]),
    )
