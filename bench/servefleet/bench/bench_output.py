"""What every benchmark writes: its JSON (with the CPU's flags and the matmul ISA cap, so a
figure is never read without the machine it came from) and its PNG beside it, and the
arguments every engine benchmark takes."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

PlotFn = Callable[[dict[str, Any], Path], None]


def engine_bench_parser(doc: str | None, out: str, threads: int = 2) -> argparse.ArgumentParser:
    """--model, --threads (of each engine) and --out (JSON; the PNG goes beside it)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=threads, help="--threads of each engine")
    p.add_argument("--out", type=Path, default=Path(out))
    return p


def save_result(out: Path, benchmark: str, fields: dict[str, Any], plot: PlotFn) -> dict[str, Any]:
    """Writes `out` (JSON) and `out` with .png through `plot(result, png_path)`."""
    from servefleet.engine.cpu_isa import cpu_flags

    result = {
        "benchmark": benchmark,
        **fields,
        "matmul_isa": os.environ.get("SERVEFLEET_MATMUL_ISA", "auto"),
        "cpu_flags": sorted(cpu_flags()),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    return result
