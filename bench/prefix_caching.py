"""Prefix caching on vs off: TTFT of a shared-system-prompt workload on our engine.

Starts the engine twice (with and without `--no-prefix-caching`), runs the same seeded
shared-prefix workload against each, and prints one JSON with the TTFT p50 ratio
(with / without; below 1 means the cache helps). Writes the JSON and a PNG.

    uv run python bench/prefix_caching.py            # full run
    uv run python bench/prefix_caching.py --num-prompts 16 --concurrency 4   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: no display here
import matplotlib.pyplot as plt

from servefleet.bench.benchmark import BenchOptions, BenchRun, run_benchmark, write_outputs
from servefleet.bench.engine_process import EngineProcess, thread_env
from servefleet.bench.workloads import WorkloadKind

MODES = {"with_prefix_caching": [], "without_prefix_caching": ["--no-prefix-caching"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--shared-prefix-tokens", type=int, default=1000)
    p.add_argument("--num-prefixes", type=int, default=1)
    p.add_argument("--input-tokens", type=int, default=32, help="unique suffix tokens")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="engine start, seconds")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="extra engine flag, repeatable (e.g. --engine-arg=--dtype=float32)",
    )
    p.add_argument(
        "--engine-command",
        default=None,
        help="command line that starts the engine (default: servefleet engine)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for the model processes (busy CPUs: 1 avoids spin-wait stalls)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/prefix_caching.json"))
    return p.parse_args(argv)


def run_mode(args: argparse.Namespace, name: str, flags: list[str]) -> BenchRun:
    log = args.out.with_name(f"{args.out.stem}.{name}.engine.log")
    with EngineProcess(
        args.model,
        log,
        [*flags, *args.engine_arg],
        ready_timeout_s=args.ready_timeout,
        env=thread_env(args.threads),
        command=shlex.split(args.engine_command) if args.engine_command else None,
    ) as engine:
        options = BenchOptions(
            url=engine.base_url,
            model=args.model,
            workload=WorkloadKind.SHARED_PREFIX,
            concurrency=args.concurrency,
            num_prompts=args.num_prompts,
            input_tokens=args.input_tokens,
            output_tokens=args.output_tokens,
            shared_prefix_tokens=args.shared_prefix_tokens,
            num_prefixes=args.num_prefixes,
            warmup=args.warmup,
            seed=args.seed,
            request_timeout_s=args.timeout,
        )
        run = asyncio.run(run_benchmark(options))
    write_outputs(run, args.out.with_name(f"{args.out.stem}.{name}.json"))
    return run


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(runs: dict[str, BenchRun], args: argparse.Namespace) -> dict[str, Any]:
    on = runs["with_prefix_caching"].summary
    off = runs["without_prefix_caching"].summary
    return {
        "benchmark": "prefix_caching",
        "model": args.model,
        "ttft_p50_ms_with": on.ttft_ms.p50,
        "ttft_p50_ms_without": off.ttft_ms.p50,
        "ttft_p50_ratio_with_over_without": _ratio(on.ttft_ms.p50, off.ttft_ms.p50),
        "ttft_p99_ratio_with_over_without": _ratio(on.ttft_ms.p99, off.ttft_ms.p99),
        "e2e_p50_ratio_with_over_without": _ratio(on.e2e_latency_ms.p50, off.e2e_latency_ms.p50),
        "request_throughput_ratio_with_over_without": _ratio(
            on.request_throughput_rps, off.request_throughput_rps
        ),
        "failed": on.failed + off.failed,
        "runs": {name: run.summary.model_dump(mode="json") for name, run in runs.items()},
    }


def plot(runs: dict[str, BenchRun], result: dict[str, Any], path: Path) -> None:
    fig, (bars, hist) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(runs)
    metrics = [("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"),
               ("e2e p50", "e2e_latency_ms", "p50")]  # fmt: skip
    width = 0.38
    for i, name in enumerate(names):
        s = runs[name].summary.model_dump()
        values = [s[m][q] or 0.0 for _, m, q in metrics]
        xs = [j + (i - 0.5) * width for j in range(len(metrics))]
        bars.bar(xs, values, width, label=name.replace("_", " "))
    bars.set_xticks(range(len(metrics)), [label for label, _, _ in metrics])
    bars.set_ylabel("ms")
    ratio = result["ttft_p50_ratio_with_over_without"]
    bars.set_title(f"TTFT p50 with/without = {ratio:.2f}" if ratio else "TTFT")
    bars.legend()
    ttfts = {
        name: [t * 1000 for r in runs[name].results if (t := r.ttft) is not None] for name in names
    }
    every = [t for values in ttfts.values() for t in values]
    if every:  # shared bins, so the two distributions compare bar for bar
        lo, hi = min(every), max(every)
        bins = [lo + (hi - lo) * i / 30 for i in range(31)] if hi > lo else 1
        for name, values in ttfts.items():
            hist.hist(values, bins=bins, alpha=0.6, label=name.replace("_", " "))
    hist.set_xlabel("TTFT (ms)")
    hist.set_ylabel("requests")
    hist.set_title("TTFT distribution")
    hist.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = {name: run_mode(args, name, flags) for name, flags in MODES.items()}
    result = compare(runs, args)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(runs, result, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
