"""The ISA matrix's four workloads, the same for every arm, and the figures taken from each.

- `random_c1`: random 200-token prompts, 128 output tokens, one at a time (TTFT and ITL p50);
- `random_c16`: the same at concurrency 16 (output tok/s, TTFT p50);
- `long_prompt`: a 1k-token prompt nobody sent before, one output token (TTFT p50 of repeats);
- `shared_prefix`: 1k-token prefixes each sent twice, 32-token unique suffixes (TTFT p50 of
  each prefix's second request, which may reuse the first one's cached prefix).

`seed` changes every prompt (each round gets fresh prompts and prefixes, so nothing an
earlier round left in the prefix cache is reused).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict

from servefleet.bench.benchmark import BenchOptions, BenchRun, run_benchmark
from servefleet.bench.report import percentile
from servefleet.bench.workloads import WorkloadKind

WORKLOADS = ("random_c1", "random_c16", "long_prompt", "shared_prefix")
# (workload, figure) -> (label, higher is better)
FIGURES: dict[str, tuple[str, bool]] = {
    "random_c1.ttft_p50_ms": ("c=1 TTFT p50 (ms)", False),
    "random_c1.itl_p50_ms": ("c=1 ITL p50 (ms)", False),
    "random_c16.output_tps": ("c=16 output tok/s", True),
    "random_c16.ttft_p50_ms": ("c=16 TTFT p50 (ms)", False),
    "long_prompt.ttft_p50_ms": ("1k unique prompt TTFT p50 (ms)", False),
    "shared_prefix.second_ttft_p50_ms": ("1k shared prefix, 2nd TTFT p50 (ms)", False),
    "peak_rss_mb": ("peak RSS (MB)", False),
    "peak_pss_mb": ("peak PSS (MB)", False),
}


class Sizes(BaseModel):
    """How much each workload sends (the full run's, or `--quick`'s)."""

    model_config = ConfigDict(frozen=True)

    input_tokens: int = 200
    output_tokens: int = 128
    c1_prompts: int = 4
    c16_prompts: int = 32
    concurrency: int = 16
    long_tokens: int = 1000
    long_repeats: int = 3
    prefix_tokens: int = 1000
    prefixes: int = 3
    suffix_tokens: int = 32
    prefix_output_tokens: int = 16


QUICK = Sizes(
    output_tokens=16,
    c1_prompts=1,
    c16_prompts=1,
    long_tokens=256,
    long_repeats=1,
    prefix_tokens=256,
    prefixes=1,
    prefix_output_tokens=4,
)


def workload_options(url: str, model: str, sizes: Sizes, seed: int) -> dict[str, BenchOptions]:
    common: dict[str, Any] = {"url": url, "model": model, "seed": seed, "request_timeout_s": 900.0}
    sized: dict[str, Any] = {
        "input_tokens": sizes.input_tokens,
        "output_tokens": sizes.output_tokens,
    }
    return {
        "random_c1": BenchOptions(
            **common, **sized, concurrency=1, num_prompts=sizes.c1_prompts, warmup=1
        ),
        "random_c16": BenchOptions(
            **common,
            **sized,
            concurrency=sizes.concurrency,
            num_prompts=sizes.c16_prompts,
            warmup=0,
        ),
        "long_prompt": BenchOptions(
            **common,
            input_tokens=sizes.long_tokens,
            output_tokens=1,
            concurrency=1,
            num_prompts=sizes.long_repeats,
            warmup=0,
        ),
        "shared_prefix": BenchOptions(
            **common,
            workload=WorkloadKind.SHARED_PREFIX,
            shared_prefix_tokens=sizes.prefix_tokens,
            num_prefixes=sizes.prefixes,
            input_tokens=sizes.suffix_tokens,
            output_tokens=sizes.prefix_output_tokens,
            concurrency=1,
            num_prompts=2 * sizes.prefixes,
            warmup=0,
        ),
    }


def figures_of(name: str, run: BenchRun) -> dict[str, float | None]:
    """The figures the matrix compares, from one workload's run (ms, tok/s)."""
    s = run.summary
    figures: dict[str, float | None] = {"failed": float(s.failed)}
    if name == "random_c1":
        figures |= {"ttft_p50_ms": s.ttft_ms.p50, "itl_p50_ms": s.itl_ms.p50}
    elif name == "random_c16":
        figures |= {"output_tps": s.output_token_throughput_tps, "ttft_p50_ms": s.ttft_ms.p50}
    elif name == "long_prompt":
        figures |= {"ttft_p50_ms": s.ttft_ms.p50}
    else:  # prompts go round the prefixes: the second half repeats the first half's prefixes
        half = len(run.results) // 2
        first = [r.ttft * 1000 for r in run.results[:half] if r.ttft is not None]
        second = [r.ttft * 1000 for r in run.results[half:] if r.ttft is not None]
        figures |= {
            "first_ttft_p50_ms": percentile(first, 50) if first else None,
            "second_ttft_p50_ms": percentile(second, 50) if second else None,
        }
    return figures


def measure(options: BenchOptions) -> BenchRun:
    return asyncio.run(run_benchmark(options))
