"""`servefleet bench`: load-test any OpenAI-compatible endpoint and print one JSON summary.

While it runs, a progress bar (stderr); at the end a table (stderr), the JSON (stdout), and
with `--out` the JSON file and its PNG plot. Exit status: 0 when every measured request
succeeded, 1 when some failed (the summary is still printed), 2 for bad options.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from pydantic import ValidationError

_FLAG_OF_FIELD = {"request_timeout_s": "--timeout", "total_timeout_s": "--total-timeout"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="model name sent in each request")
    parser.add_argument(
        "--workload",
        choices=["random", "shared-prefix"],
        default="random",
        help="random prompts, or prompts sharing prefixes (prefix-cache benefit)",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--num-prompts", type=int, default=64, help="measured requests")
    parser.add_argument(
        "--input-tokens",
        type=int,
        default=200,
        help="prompt tokens (shared-prefix: unique suffix tokens)",
    )
    parser.add_argument("--output-tokens", type=int, default=128, help="max_tokens (ignore_eos)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    parser.add_argument(
        "--api-key", default=None, help="sent as a Bearer token (default: none sent)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="requests sent first, not counted")
    parser.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="completions: token-id prompts; chat: text prompts",
    )
    parser.add_argument(
        "--shared-prefix-tokens", type=int, default=1000, help="shared-prefix: prefix tokens"
    )
    parser.add_argument(
        "--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    parser.add_argument("--total-timeout", type=float, default=3600.0, help="whole run, seconds")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="also write the JSON here and a PNG plot next to it (default: stdout only)",
    )
    parser.add_argument(
        "--tokenizer-model",
        default=None,
        help="calibrate chat text lengths with our tokenizer (GGUF path; default: estimate)",
    )


def run(args: argparse.Namespace) -> int:
    # Imported here so `servefleet --help` stays fast.
    from servefleet.bench.benchmark import BenchOptions, run_benchmark, write_outputs
    from servefleet.cli.bench_output import ProgressBar, summary_table

    try:
        options = BenchOptions(
            url=args.url,
            model=args.model,
            workload=args.workload,
            concurrency=args.concurrency,
            num_prompts=args.num_prompts,
            input_tokens=args.input_tokens,
            output_tokens=args.output_tokens,
            seed=args.seed,
            api_key=args.api_key,
            warmup=args.warmup,
            endpoint=args.endpoint,
            shared_prefix_tokens=args.shared_prefix_tokens,
            num_prefixes=args.num_prefixes,
            request_timeout_s=args.timeout,
            total_timeout_s=args.total_timeout,
            tokenizer_model=args.tokenizer_model,
        )
    except ValidationError as exc:
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else ""
            field = _FLAG_OF_FIELD.get(name, "--" + name.replace("_", "-"))
            print(f"servefleet bench: {field}: {err['msg']}", file=sys.stderr)
        return 2
    try:
        bench_run = asyncio.run(run_benchmark(options, ProgressBar()))
    except (RuntimeError, ValueError) as exc:  # e.g. the optional tokenizer failed to load
        print(f"servefleet bench: {exc}", file=sys.stderr)
        return 2
    print(summary_table(bench_run.summary), file=sys.stderr)
    if args.out is not None:
        png = write_outputs(bench_run, args.out)
        print(f"wrote {args.out} and {png}", file=sys.stderr)
    print(json.dumps(bench_run.summary.model_dump(mode="json"), indent=2))
    return 0 if bench_run.summary.failed == 0 else 1
