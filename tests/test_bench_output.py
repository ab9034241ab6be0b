"""Every benchmark's JSON names itself and the machine it ran on, and gets its PNG beside it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from servefleet.bench.bench_output import engine_bench_parser, save_result


def test_a_result_records_the_cpu_and_its_plot_is_written_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SERVEFLEET_MATMUL_ISA", "avx2")
    plotted: list[tuple[dict[str, Any], Path]] = []
    out = tmp_path / "deep" / "bench.json"
    result = save_result(out, "bench", {"ratio": 2.5}, lambda r, png: plotted.append((r, png)))
    assert json.loads(out.read_text()) == result
    assert result["benchmark"] == "bench" and result["ratio"] == 2.5
    assert result["matmul_isa"] == "avx2" and isinstance(result["cpu_flags"], list)
    assert plotted == [(result, tmp_path / "deep" / "bench.png")]


def test_engine_benchmarks_share_their_arguments() -> None:
    args = engine_bench_parser("doc", "bench/results/x.json", threads=1).parse_args(
        ["--threads", "3"]
    )
    assert (args.model, args.threads, args.out) == (
        "smollm2-135m-instruct",
        3,
        Path("bench/results/x.json"),
    )
