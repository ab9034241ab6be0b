"""Traces from the gateway's access log (`servefleet.api.access_log`), and back.

Replay keeps what the log saw: arrival times, traffic class, tokens, and the time each served
request held a slot. Requests the log shows spilled or shed were never timed on a replica;
they get the median seconds per token of the served ones, so the replay asks what serving them
would have taken. `write_access_log` turns any trace into such a log: the bench uses it to
exercise the replay path end to end on a seeded "office week".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from servefleet.api.access_log import AccessLogLine, dump_lines, parse_lines
from servefleet.api.outcomes import Outcome

from .sim_trace import Trace, TraceSpec, make_trace

DEPLOYMENT = "replayed"


def read_access_log(path: Path, deployment: str | None = None) -> Trace:
    """The log's requests (one deployment's, if named), times relative to the first."""
    with path.open() as handle:
        lines = [
            line
            for line in parse_lines(handle)
            if line.offered_to_pool and (deployment is None or line.deployment == deployment)
        ]
    if not lines:
        raise ValueError(f"{path}: no requests" + (f" for {deployment}" if deployment else ""))
    lines.sort(key=lambda line: line.ts)
    start = lines[0].ts
    timed = [ln.service_s / max(ln.tokens, 1) for ln in lines if ln.outcome is Outcome.OK]
    per_token = float(np.median(timed)) if timed else 0.015
    arrivals = np.array([ln.ts - start for ln in lines])
    service = np.array(
        [ln.service_s if ln.outcome is Outcome.OK else ln.tokens * per_token for ln in lines]
    )
    return Trace(
        name=f"log:{path.name}",
        duration_s=float(arrivals[-1]) + 1.0,
        arrivals_s=arrivals,
        service_s=np.maximum(service, 1e-3),
        tokens=np.array([ln.tokens for ln in lines], dtype=np.int64),
        batch=np.array([ln.traffic_class == "batch" for ln in lines]),
    )


def write_access_log(trace: Trace, path: Path, epoch: float = 1_767_225_600.0) -> None:
    """Each request of `trace` as a served log line (no queueing: the offered load only)."""
    rng = np.random.default_rng(0)
    completion = np.minimum(trace.tokens, np.round(trace.service_s * 33.0)).astype(int)
    lines = (
        AccessLogLine(
            ts=epoch + float(t),
            deployment=DEPLOYMENT,
            tenant=f"team-{int(rng.integers(0, 5))}",
            traffic_class="batch" if bool(b) else "interactive",
            prompt_tokens=int(tok - out),
            completion_tokens=int(out),
            ttft_s=0.1,
            duration_s=float(s),
        )
        for t, s, tok, out, b in zip(
            trace.arrivals_s, trace.service_s, trace.tokens, completion, trace.batch, strict=True
        )
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for text in dump_lines(lines):
            handle.write(text + "\n")


def office_week_log(path: Path, seed: int = 5, hours: float = 6.0) -> Path:
    """A seeded stand-in for a real log: a working day's curve, a batch share, few spikes."""
    spec = TraceSpec(
        duration_s=hours * 3600,
        peak_rate=6.0,
        trough_share=0.05,
        spikes=3,
        spike_multiplier=(2.0, 3.0),
        spike_duration_s=(30.0, 120.0),
        batch_share=0.25,
        seed=seed,
    )
    write_access_log(make_trace(spec), path)
    return path
