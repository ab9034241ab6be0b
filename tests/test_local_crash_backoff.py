"""An engine that keeps crashing: restarted with exponential back-off (capped), and its last
log lines shown on the console, not only in its log file."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest

from servefleet.local.crash_backoff import CrashBackoff, last_lines
from servefleet.local.supervisor import DeploymentSupervisor
from tests.support.local_fakes import FAILING_ENGINE


def test_backoff_doubles_from_the_second_crash_up_to_the_cap() -> None:
    backoff = CrashBackoff(base_s=1.0, cap_s=8.0, reset_after_s=60.0)
    delays = [backoff.crashed(now=float(i), ready_for_s=None) for i in range(7)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert not backoff.may_start(6.0 + 7.9) and backoff.may_start(6.0 + 8.0)


def test_a_replica_that_served_long_enough_resets_the_count() -> None:
    backoff = CrashBackoff(base_s=1.0, cap_s=8.0, reset_after_s=60.0)
    for i in range(4):
        backoff.crashed(now=float(i), ready_for_s=5.0)  # ready, but only briefly
    assert backoff.crashes == 4
    assert backoff.crashed(now=100.0, ready_for_s=61.0) == 0.0
    assert backoff.crashes == 1


def test_last_lines_skips_blanks_and_survives_a_missing_file(tmp_path: Path) -> None:
    log = tmp_path / "r.log"
    log.write_text("".join(f"line {i}\n\n" for i in range(20)))
    assert last_lines(log, count=3) == ["line 17", "line 18", "line 19"]
    assert last_lines(tmp_path / "absent.log") == []


async def test_crashing_engine_is_restarted_with_backoff_and_its_error_shown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = tmp_path / "failing_engine.py"
    script.write_text(FAILING_ENGINE)
    sup = DeploymentSupervisor(
        "broken",
        lambda port: [sys.executable, str(script), str(port)],
        log_dir=tmp_path / "logs",
        poll_interval_s=0.02,
        backoff=CrashBackoff(base_s=0.4, cap_s=0.8),
    )
    sup.scale(1)
    caplog.set_level(logging.INFO, logger="servefleet.local.supervisor")
    runner = asyncio.create_task(sup.run())

    def starts() -> list[float]:
        return [e.at for e in sup.timeline if e.event.startswith("started")]

    try:
        async with asyncio.timeout(60):
            while len(starts()) < 5:
                await asyncio.sleep(0.02)
    finally:
        await sup.stop()
        runner.cancel()
    exits = [e.at for e in sup.timeline if "unexpectedly" in e.event]
    # The wait between a crash and the next start: none, then 0.4 s, 0.8 s, 0.8 s (capped).
    waits = [start - crash for crash, start in zip(exits, starts()[1:], strict=False)]
    # Lower bounds only (the back-off guarantees them; what a busy machine adds on top is not
    # the supervisor's): the first restart waits less than the second, which waits its 0.4 s.
    assert waits[0] < waits[1]
    assert waits[1] >= 0.4 and min(waits[2], waits[3]) >= 0.8
    crash_lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("exited 3 unexpectedly (crash 2 in a row)" in m for m in crash_lines)
    assert any(m.endswith("| boom: cannot load no-such-model") for m in crash_lines)
