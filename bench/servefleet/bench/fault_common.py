"""What every fault scenario shares: its scale, its result, bounded polls and the figures read
from the stack's own /metrics (tokens charged, engines idle, RSS).

A scenario applies load to a running `Stack`, causes one fault, and returns its figures and the
invariants it broke (an empty list is a pass). The same functions run short in e2e (CI) and long
from `fault_suite` (`make soak`); only `Scale` differs. Waits for recovery are bounded polls
whose duration is reported, never a timed assertion.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from servefleet.bench.fault_load import LoadResult, Outcome
from servefleet.bench.fault_stack import Part, Stack, metric_sum, scrape
from servefleet.gateway.metrics import PREFIX

COMPLETION_TOKENS = PREFIX + "completion_tokens_total"
LIMITS_DEGRADED = PREFIX + "limits_degraded"
IN_FLIGHT = PREFIX + "in_flight"
QUEUE_WAIT_BUCKET = PREFIX + "queue_wait_seconds_bucket"
QUEUE_WAIT_COUNT = PREFIX + "queue_wait_seconds_count"
ENGINE_RUNNING = "vllm:num_requests_running"
ENGINE_KV_USAGE = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True)
class Scale:
    """How long and how hard: `short` for CI, `full` for the soak run."""

    seconds: float
    overload_factor: int = 10

    @classmethod
    def short(cls) -> Scale:
        return cls(seconds=20.0)

    @classmethod
    def full(cls) -> Scale:
        return cls(seconds=300.0)


@dataclass
class ScenarioResult:
    name: str
    figures: dict[str, Any] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def require(self, ok: bool, what: str) -> None:
        if not ok:
            self.violations.append(what)


def poll(check: Callable[[], bool], timeout_s: float, interval_s: float = 0.25) -> float | None:
    """Seconds until `check()` held, or None if it never did within `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if check():
            return round(time.monotonic() - start, 2)
        time.sleep(interval_s)
    return None


def charged_tokens(stack: Stack) -> float:
    """Completion tokens the gateways counted for every tenant (what tenants are charged)."""
    return sum(metric_sum(scrape(g.internal_url), COMPLETION_TOKENS) for g in stack.gateways)


def engines_idle(stack: Stack) -> bool:
    """No sequence running and no KV block held on any engine."""
    for engine in stack.engines:
        samples = scrape(engine.url)
        if metric_sum(samples, ENGINE_RUNNING) or metric_sum(samples, ENGINE_KV_USAGE):
            return False
    return True


def settle(stack: Stack) -> None:
    """Wait (bounded) until the engines are idle: a scenario that counts tokens charged must not
    count the tail of the one before it."""
    poll(lambda: engines_idle(stack), timeout_s=60)


def rss_mb(parts: list[Part]) -> dict[str, float]:
    found: dict[str, float] = {}
    for part in parts:
        if part.alive():
            assert part.proc is not None
            found[part.name] = round(psutil.Process(part.proc.pid).memory_info().rss / 2**20, 1)
    return found


def no_losses(result: ScenarioResult, load: LoadResult) -> None:
    counts = load.counts()
    result.figures["load"] = load.summary()
    for bad in (Outcome.FAILED, Outcome.HUNG, Outcome.REFUSED_BARE, Outcome.ERROR_EVENT):
        result.require(counts[bad.value] == 0, f"{counts[bad.value]} requests {bad.value}")
