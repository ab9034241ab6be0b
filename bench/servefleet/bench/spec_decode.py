"""Speculative decoding (n-gram prompt lookup) on vs off, same prompts, same run.

Two workloads per engine: "rewrite this passage with one change" at concurrency 1
(input-grounded: the answer copies the input; goal ≥ 2× lower per-token latency with
speculation) and the random workload at concurrency 16 (goal: no slower). Per-token
latency is TPOT, (e2e − TTFT) / (tokens − 1): a speculative step streams several tokens in
one chunk, so the gap between chunks (`itl_ms`) is per step, not per token. Prints one
JSON, writes it and a PNG.

    uv run python -m servefleet.bench.spec_decode                 # ~2 minutes
    uv run python -m servefleet.bench.spec_decode --rewrite-prompts 2 --random-prompts 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import httpx

from servefleet.bench.benchmark import BenchOptions, BenchRun, run_benchmark, run_prompts
from servefleet.bench.client import ClientConfig, Endpoint
from servefleet.bench.engine_process import EngineProcess, thread_env
from servefleet.bench.spec_decode_passages import rewrite_prompts
from servefleet.bench.spec_decode_plot import plot
from servefleet.bench.workloads import WorkloadKind

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 5}'
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--speculative-config", default=DEFAULT_SPEC)
    p.add_argument("--rewrite-prompts", type=int, default=4, help="c=1 rewrite requests")
    p.add_argument("--rewrite-output-tokens", type=int, default=192)
    p.add_argument("--random-prompts", type=int, default=32, help="c=16 random requests")
    p.add_argument("--random-concurrency", type=int, default=16)
    p.add_argument("--random-input-tokens", type=int, default=200)
    p.add_argument("--random-output-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the engine")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=Path("bench/results/spec_decode.json"))
    return p.parse_args(argv)


def spec_counters(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values = {}
    for name in SPEC_COUNTERS:
        match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        values[name.removeprefix("vllm:spec_decode_").removesuffix("_total")] = (
            float(match.group(1)) if match else 0.0
        )
    return values


def run_rewrite(args: argparse.Namespace, url: str) -> BenchRun:
    config = ClientConfig(
        url=url,
        model=args.model,
        endpoint=Endpoint.CHAT,
        concurrency=1,
        output_tokens=args.rewrite_output_tokens,
        request_timeout_s=600,
    )
    prompts = rewrite_prompts(args.rewrite_prompts + 1)
    params = {"workload": "rewrite", "concurrency": 1, "output_tokens": config.output_tokens}
    return asyncio.run(run_prompts(config, prompts[1:], prompts[:1], params))


def run_random(args: argparse.Namespace, url: str) -> BenchRun:
    options = BenchOptions(
        url=url,
        model=args.model,
        workload=WorkloadKind.RANDOM,
        concurrency=args.random_concurrency,
        num_prompts=args.random_prompts,
        input_tokens=args.random_input_tokens,
        output_tokens=args.random_output_tokens,
        warmup=args.random_concurrency,
        request_timeout_s=600,
    )
    return asyncio.run(run_benchmark(options))


def run_mode(args: argparse.Namespace, name: str, flags: list[str]) -> dict[str, Any]:
    log = args.out.with_name(f"{args.out.stem}.{name}.engine.log")
    engine_flags = [*flags, "--max-num-seqs", str(args.random_concurrency)]
    with EngineProcess(
        args.model,
        log,
        engine_flags,
        ready_timeout_s=args.ready_timeout,
        env=thread_env(args.threads),
    ) as engine:
        before = spec_counters(engine.base_url)
        rewrite = run_rewrite(args, engine.base_url)
        after_rewrite = spec_counters(engine.base_url)
        random_run = run_random(args, engine.base_url)
        after_random = spec_counters(engine.base_url)
    return {
        "rewrite_c1": rewrite.summary.model_dump(mode="json"),
        "random_c16": random_run.summary.model_dump(mode="json"),
        "spec_rewrite": {k: after_rewrite[k] - before[k] for k in before},
        "spec_random": {k: after_random[k] - after_rewrite[k] for k in before},
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    plain, spec = runs["plain"], runs["ngram"]
    accepted = spec["spec_rewrite"]
    return {
        "benchmark": "spec_decode",
        "model": args.model,
        "speculative_config": json.loads(args.speculative_config),
        "c1_rewrite_tpot_p50_ms": {
            "plain": plain["rewrite_c1"]["tpot_ms"]["p50"],
            "ngram": spec["rewrite_c1"]["tpot_ms"]["p50"],
        },
        "c1_rewrite_tpot_ratio_plain_over_ngram": _ratio(
            plain["rewrite_c1"]["tpot_ms"]["mean"], spec["rewrite_c1"]["tpot_ms"]["mean"]
        ),
        "c1_rewrite_output_tps_ratio_ngram_over_plain": _ratio(
            spec["rewrite_c1"]["output_token_throughput_tps"],
            plain["rewrite_c1"]["output_token_throughput_tps"],
        ),
        "c1_rewrite_acceptance_rate": _ratio(
            accepted["num_accepted_tokens"], accepted["num_draft_tokens"]
        ),
        "c1_rewrite_mean_tokens_per_step": 1
        + (_ratio(accepted["num_accepted_tokens"], accepted["num_drafts"]) or 0.0),
        "c16_random_output_tps_ratio_ngram_over_plain": _ratio(
            spec["random_c16"]["output_token_throughput_tps"],
            plain["random_c16"]["output_token_throughput_tps"],
        ),
        "c16_random_drafts": spec["spec_random"]["num_drafts"],
        "failed": sum(r[w]["failed"] for r in runs.values() for w in ("rewrite_c1", "random_c16")),
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    modes = {"plain": [], "ngram": ["--speculative-config", args.speculative_config]}
    runs = {name: run_mode(args, name, flags) for name, flags in modes.items()}
    result = compare(runs, args)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    summary = {k: v for k, v in result.items() if k != "runs"}
    print(json.dumps(summary, indent=2))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
