"""What every attack of the attack suite shares: the victim's load, its p99, and the verdict.

An attack runs against a stack of real processes while another tenant (the victim) sends small
streamed chats through the same gateway. It passes when the attacker gets nothing it should
not (each attack states what that means and checks it) *and* the victim's p99 latency under
attack stays within `P99_FACTOR` of its p99 in a quiet run of the same length, measured on the
same stack just before. Figures are reported whether or not it passes; a failed check is a
violation, never a skip.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from servefleet.bench.fault_load import LoadResult, Outcome, RequestSpec, send
from servefleet.bench.report import percentile

P99_FACTOR = 2.0
VICTIM_CLIENTS = 2
# Short answers: each request is a few engine steps, so p99 moves when anything stalls.
VICTIM_SPEC = RequestSpec(
    prompt="Name a colour.", max_tokens=8, temperature=0.0, prompts=8, deadline_s=60
)


@dataclass
class AttackResult:
    """One row of the attack table."""

    name: str
    attack: str  # what the attacker does, one line
    outcome: str = ""  # what the attacker got, one line
    victim: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def require(self, ok: bool, what: str) -> None:
        if not ok:
            self.violations.append(what)


@dataclass(frozen=True)
class VictimFigures:
    """The victim's requests in one window: p99 of the whole request, and what went wrong."""

    requests: int
    p50_ms: float | None
    p99_ms: float | None
    not_ok: dict[str, int]

    @classmethod
    def of(cls, load: LoadResult) -> VictimFigures:
        seconds = [r.seconds * 1000 for r in load.records if r.outcome is Outcome.OK]
        counts = {k: v for k, v in load.counts().items() if v and k != Outcome.OK.value}
        return cls(
            requests=len(load.records),
            p50_ms=round(percentile(seconds, 50), 1) if seconds else None,
            p99_ms=round(percentile(seconds, 99), 1) if seconds else None,
            not_ok=counts,
        )


async def _victim_clients(url: str, tenant: str, min_s: float, stop: threading.Event) -> LoadResult:
    """`VICTIM_CLIENTS` closed-loop clients until `stop` is set and `min_s` has passed."""
    result = LoadResult()
    until = time.monotonic() + min_s
    async with httpx.AsyncClient(timeout=httpx.Timeout(VICTIM_SPEC.deadline_s)) as client:

        async def one_client() -> None:
            while not stop.is_set() or time.monotonic() < until:
                record = await send(client, url, tenant, VICTIM_SPEC, len(result.records))
                result.records.append(record)
                if record.outcome is Outcome.REFUSED:
                    await asyncio.sleep(record.retry_after_s or 0.0)

        await asyncio.gather(*(one_client() for _ in range(VICTIM_CLIENTS)))
    return result


class VictimWindow:
    """The victim's load in a background thread while the `with` block runs (at least `min_s`)."""

    def __init__(self, url: str, tenant: str, min_s: float) -> None:
        self._args = (url, tenant, min_s)
        self._stop = threading.Event()
        self._result: LoadResult | None = None
        self._thread = threading.Thread(target=self._run, name="victim", daemon=True)

    def _run(self) -> None:
        self._result = asyncio.run(_victim_clients(*self._args, self._stop))

    def __enter__(self) -> VictimWindow:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def figures(self) -> VictimFigures:
        assert self._result is not None, "the window has not ended"
        return VictimFigures.of(self._result)


def judge_victim(result: AttackResult, quiet: VictimFigures, attacked: VictimFigures) -> None:
    """The victim kept its latency and lost nothing."""
    result.victim = {
        "quiet_p99_ms": quiet.p99_ms,
        "attack_p99_ms": attacked.p99_ms,
        "attack_p50_ms": attacked.p50_ms,
        "requests": attacked.requests,
        "not_ok": attacked.not_ok,
    }
    result.require(not attacked.not_ok, f"victim requests not ok under attack: {attacked.not_ok}")
    if quiet.p99_ms is None or attacked.p99_ms is None:
        result.require(False, "victim got no answer to measure")
        return
    ratio = attacked.p99_ms / quiet.p99_ms
    result.victim["p99_ratio"] = round(ratio, 2)
    result.require(
        ratio <= P99_FACTOR,
        f"victim p99 {attacked.p99_ms:.0f} ms under attack vs {quiet.p99_ms:.0f} ms quiet "
        f"({ratio:.2f}x > {P99_FACTOR}x)",
    )


class Watch:
    """Polls probe URLs every `interval_s` in a background thread and keeps the slowest answer
    (or a failure) of each: what "health kept answering during the attack" is measured by."""

    def __init__(
        self, urls: dict[str, str], interval_s: float = 0.25, timeout_s: float = 5.0
    ) -> None:
        self.urls = urls
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.slowest_ms: dict[str, float] = dict.fromkeys(urls, 0.0)
        self.failures: dict[str, int] = dict.fromkeys(urls, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watch", daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                for name, url in self.urls.items():
                    start = time.monotonic()
                    try:
                        ok = client.get(url).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    elapsed = (time.monotonic() - start) * 1000
                    self.slowest_ms[name] = max(self.slowest_ms[name], round(elapsed, 1))
                    self.failures[name] += not ok
                self._stop.wait(self.interval_s)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def require_alive(self, result: AttackResult, slowest_allowed_ms: float = 2000.0) -> None:
        result.figures["probe_slowest_ms"] = self.slowest_ms
        for name in self.urls:
            result.require(self.failures[name] == 0, f"{name} failed {self.failures[name]} probes")
            result.require(
                self.slowest_ms[name] <= slowest_allowed_ms,
                f"{name} took {self.slowest_ms[name]:.0f} ms to answer a probe",
            )


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    """(what `call` returned, seconds it took)."""
    start = time.monotonic()
    value = call()
    return value, round(time.monotonic() - start, 2)
