"""The soak: mixed load for a long time, sampling every process's memory and open files, then
checking that the engines hand every KV block back once it stops."""

from __future__ import annotations

import asyncio
import os
import time

import psutil

from servefleet.bench.fault_common import Scale, ScenarioResult, engines_idle, no_losses, poll
from servefleet.bench.fault_load import LoadResult, Outcome, RequestSpec, closed_loop
from servefleet.bench.fault_stack import TENANTS, Part, Stack

SAMPLE_EVERY_S = 5.0


def _sample(parts: list[Part]) -> dict[str, tuple[float, int]]:
    """(RSS in MiB, open file descriptors) per live process."""
    found: dict[str, tuple[float, int]] = {}
    for part in parts:
        if part.alive() and part.proc is not None:
            proc = psutil.Process(part.proc.pid)
            found[part.name] = (proc.memory_info().rss / 2**20, proc.num_fds())
    return found


def slope_per_minute(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute (RSS: MiB per minute)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return 60 * cov / var if var else 0.0


def soak(stack: Stack, scale: Scale) -> ScenarioResult:
    """Streams, short and long answers and clients that leave, from two tenants at once; RSS
    and file descriptors sampled over the second half (the first is warm-up)."""
    result = ScenarioResult("soak")
    gateway = stack.gateways[0]
    samples: list[tuple[float, dict[str, tuple[float, int]]]] = []

    async def sampler(start: float) -> None:
        while (elapsed := time.monotonic() - start) < scale.seconds:
            samples.append((elapsed, _sample(stack.parts())))
            await asyncio.sleep(SAMPLE_EVERY_S)

    async def run() -> list[LoadResult]:
        start = time.monotonic()
        loads = [
            closed_loop(gateway.url, TENANTS[0], 3, scale.seconds, RequestSpec(max_tokens=8)),
            closed_loop(gateway.url, TENANTS[1], 2, scale.seconds, RequestSpec(max_tokens=96)),
            closed_loop(
                gateway.url,
                TENANTS[1],
                1,
                scale.seconds,
                RequestSpec(max_tokens=200, leave_after_tokens=10),
            ),
        ]
        results = await asyncio.gather(*loads, sampler(start))
        return [r for r in results if isinstance(r, LoadResult)]

    merged = LoadResult(records=[r for load in asyncio.run(run()) for r in load.records])
    stayed = [r for r in merged.records if r.outcome is not Outcome.LEFT]  # left on purpose
    no_losses(result, LoadResult(records=stayed))
    idle = poll(lambda: engines_idle(stack), timeout_s=30)
    second_half = [(t, s) for t, s in samples if t >= scale.seconds / 2]
    names = sorted({name for _, s in second_half for name in s})
    slopes = {
        n: round(slope_per_minute([(t, s[n][0]) for t, s in second_half if n in s]), 2)
        for n in names
    }
    fd_growth = {
        n: second_half[-1][1][n][1] - second_half[0][1][n][1]
        for n in names
        if second_half and n in second_half[0][1] and n in second_half[-1][1]
    }
    result.figures.update(
        load=merged.summary(),
        rss_slope_mb_per_min=slopes,
        fd_growth=fd_growth,
        seconds_to_idle=idle,
        samples=len(samples),
        cpus=os.cpu_count(),
    )
    result.require(idle is not None, "KV blocks or sequences still held 30 s after the load")
    result.require(all(g <= 8 for g in fd_growth.values()), f"file descriptors grew: {fd_growth}")
    return result
