"""Long work shows progress: GGUF conversion on a first start (and nothing on a cache hit),
and `servefleet bench` (a bar while it runs, then a table; stdout stays pure JSON)."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from servefleet.bench.client import RequestResult
from servefleet.bench.report import summarize
from servefleet.cli.bench_output import ProgressBar, summary_table
from servefleet.engine.model.conversion_cache import ConversionProgress

LOGGER = "servefleet.engine.model.conversion_cache"


def test_conversion_progress_lines_are_paced_by_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = tmp_path / "m.gguf"
    source.write_bytes(b"x" * 2_000_000)
    now = [0.0]
    caplog.set_level(logging.INFO, logger=LOGGER)
    progress = ConversionProgress(source, 100, interval_s=25.0, clock=lambda: now[0])
    for _ in range(100):
        now[0] += 1.0  # 100 s in all: a line every 25 s, none for the last step
        progress.step()
    progress.done(tmp_path / "cache")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(f"converting: source={source} size_mb=2")
    assert [m.split(" (")[0] for m in lines[1:-1]] == [
        "converting: 25%",
        "converting: 50%",
        "converting: 75%",
    ]
    assert lines[-1] == f"converted: source={source} seconds=100.0 cached_in={tmp_path / 'cache'}"


def test_first_start_converts_with_progress_and_a_cache_hit_is_quiet(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from servefleet.engine.model.loader import read_checkpoint

    caplog.set_level(logging.INFO, logger=LOGGER)
    read_checkpoint("smollm2-135m-instruct", cache_root=tmp_path)
    first = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert first[0].startswith("converting: source=") and first[-1].startswith("converted:")
    caplog.clear()
    read_checkpoint("smollm2-135m-instruct", cache_root=tmp_path)
    assert [r for r in caplog.records if r.name == LOGGER] == []


def _result(index: int, ok: bool = True) -> RequestResult:
    result = RequestResult(index=index, start=0.0, end=0.5, error=None if ok else "HTTP 500")
    return result


def test_bench_progress_in_a_log_is_a_line_per_tenth() -> None:
    out = io.StringIO()
    bar = ProgressBar(out, interactive=False)
    bar.phase("measure", 20)
    for i in range(20):
        bar.finished(_result(i, ok=i != 3))
    lines = out.getvalue().splitlines()
    assert len(lines) == 11  # 0/20, then each tenth
    assert lines[0].startswith("measure  [" + "." * 30 + "] 0/20 requests")
    assert "[" + "#" * 30 + "] 20/20 requests, 1 failed" in lines[-1]


def test_bench_progress_on_a_terminal_redraws_one_line() -> None:
    out = io.StringIO()
    bar = ProgressBar(out, interactive=True)
    bar.phase("warm-up", 2)
    bar.finished(_result(0))
    bar.finished(_result(1))
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("2/2 requests 0.0s\n")


def test_bench_table_lists_latencies_and_throughput() -> None:
    summary = summarize([_result(0), _result(1), _result(2, ok=False)], 2.0, {})
    table = summary_table(summary)
    assert "requests: 2 completed, 1 failed in 2.0s" in table
    assert "throughput: 1.00 req/s" in table
    e2e = next(line for line in table.splitlines() if line.startswith("E2E latency"))
    assert e2e.split()[-3:] == ["500.0", "500.0", "500.0"]
    assert "error: HTTP 500" in table
