"""What `servefleet bench` shows a person: a progress bar while it runs, then a table.

All of it goes to stderr: stdout carries only the JSON summary, so `servefleet bench … >
run.json` still works. On a terminal the bar redraws in place; in a log (not a TTY) it is
a line at each tenth of the requests.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from servefleet.bench.benchmark import BenchProgress
from servefleet.bench.client import RequestResult
from servefleet.bench.report import BenchSummary, Distribution

BAR_WIDTH = 30


class ProgressBar(BenchProgress):
    def __init__(self, stream: TextIO | None = None, *, interactive: bool | None = None) -> None:
        self._stream = stream or sys.stderr
        self._interactive = self._stream.isatty() if interactive is None else interactive
        self._name, self._total, self._done, self._failed = "", 0, 0, 0
        self._started = time.monotonic()
        self._last_tenth = -1

    def phase(self, name: str, total: int) -> None:
        self._end_line()
        self._name, self._total, self._done, self._failed = name, total, 0, 0
        self._started = time.monotonic()
        self._last_tenth = -1
        self._draw()

    def finished(self, result: RequestResult) -> None:
        self._done += 1
        self._failed += 0 if result.ok else 1
        self._draw()
        if self._done == self._total:
            self._end_line()

    def line(self) -> str:
        filled = BAR_WIDTH * self._done // max(1, self._total)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        failed = f", {self._failed} failed" if self._failed else ""
        elapsed = time.monotonic() - self._started
        return f"{self._name:8} [{bar}] {self._done}/{self._total} requests{failed} {elapsed:.1f}s"

    def _draw(self) -> None:
        if self._interactive:
            self._stream.write("\r" + self.line())
            self._stream.flush()
            return
        tenth = 10 * self._done // max(1, self._total)
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            self._stream.write(self.line() + "\n")
            self._stream.flush()

    def _end_line(self) -> None:
        if self._interactive and self._total:
            self._stream.write("\n")
            self._stream.flush()


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def summary_table(summary: BenchSummary) -> str:
    """The figures a person reads first, as a fixed-width table."""
    rows: list[tuple[str, Distribution]] = [
        ("TTFT", summary.ttft_ms),
        ("TPOT", summary.tpot_ms),
        ("ITL", summary.itl_ms),
        ("E2E latency", summary.e2e_latency_ms),
    ]
    lines = [
        f"requests: {summary.completed} completed, {summary.failed} failed "
        f"in {summary.duration_s:.1f}s",
        f"throughput: {summary.request_throughput_rps:.2f} req/s, "
        f"{summary.output_token_throughput_tps:.1f} output tok/s, "
        f"{summary.total_token_throughput_tps:.1f} total tok/s",
        "",
        f"{'ms':<12} {'mean':>10} {'p50':>10} {'p99':>10}",
    ]
    for name, dist in rows:
        lines.append(f"{name:<12} {_ms(dist.mean):>10} {_ms(dist.p50):>10} {_ms(dist.p99):>10}")
    lines.extend(f"error: {e}" for e in summary.errors)
    return "\n".join(lines)
