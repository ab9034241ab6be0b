"""Disaggregated prefill/decode against colocated serving: the inter-token latency of
streams that are decoding while long prompts arrive.

Two real engine processes, one thread each, in both arms (the same processes: the same
cores). A few short-prompt streams decode for a while; meanwhile long prompts arrive one
after another. Colocated, each engine serves half the streams and every other long prompt,
so a long prompt's chunks share its engine's steps with the decodes there. P/D, engine 0
only prefills (`kv_transfer_params.remote_prefill`: it computes the prompt and streams the
blocks) and engine 1 decodes everything: the decode steps only ever carry one partial block
of a long prompt. Every long prompt starts differently, so nothing is a cache hit. Reported:
the decoding streams' ITL p50/p99 and the long prompts' TTFT, per arm. Writes JSON (CPU
flags included) and a PNG.

    uv run python -m servefleet.bench.kv_pd          # ~3 minutes here
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from servefleet.bench.bench_output import engine_bench_parser, save_result
from servefleet.bench.engine_process import EngineProcess, thread_env
from servefleet.bench.kv_transfer import AUTH, KEY
from servefleet.bench.kv_transfer import prompt as long_prompt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = engine_bench_parser(__doc__, "bench/results/kv_pd.json", threads=1)
    p.add_argument("--streams", type=int, default=4, help="decoding streams")
    p.add_argument("--stream-tokens", type=int, default=160, help="tokens each stream decodes")
    p.add_argument("--long-prompts", type=int, default=4)
    p.add_argument("--sentences", type=int, default=60, help="~17 tokens each: ~1k tokens")
    p.add_argument("--gap-s", type=float, default=1.5, help="between long prompts")
    return p.parse_args(argv)


async def stream_times(
    client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int, extra: dict[str, Any]
) -> list[float]:
    """Arrival times of a streamed completion's tokens (one event per step here)."""
    body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True, **extra}
    times = [time.perf_counter()]
    async with client.stream("POST", base + "/v1/completions", json=body, headers=AUTH) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    return times


async def run_arm(args: argparse.Namespace, bases: list[str], pd: bool, tag: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as client:
        decoders = [bases[1] if pd else bases[i % 2] for i in range(args.streams)]
        streams = [
            asyncio.create_task(
                stream_times(client, base, f"Story {tag} {i}: once", args.stream_tokens, {})
            )
            for i, base in enumerate(decoders)
        ]
        await asyncio.sleep(1.0)  # the streams are decoding
        ttfts = []
        for k in range(args.long_prompts):
            text = long_prompt(f"{tag}-{k}", args.sentences)
            extra: dict[str, Any] = {}
            base = bases[k % 2]
            if pd:
                base = bases[1]
                extra = {"kv_transfer_params": {"remote_prefill": bases[0], "deadline_s": 60}}
            times = await stream_times(client, base, text, 2, extra)
            ttfts.append(times[1] - times[0])
            await asyncio.sleep(args.gap_s)
        results = await asyncio.gather(*streams)
    itls = [b - a for times in results for a, b in itertools.pairwise(times[1:])]  # no TTFT
    itls.sort()
    return {
        "arm": "pd" if pd else "colocated",
        "itl_p50_ms": statistics.median(itls) * 1000,
        "itl_p99_ms": itls[int(0.99 * (len(itls) - 1))] * 1000,
        "itl_p999_ms": itls[int(0.999 * (len(itls) - 1))] * 1000,
        "itl_max_ms": itls[-1] * 1000,
        "itls_over_500ms": sum(1 for x in itls if x > 0.5),
        "long_ttft_p50_s": statistics.median(ttfts),
        "long_ttfts_s": ttfts,
        "itl_samples": len(itls),
    }


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    flags = ["--api-key", KEY, "--kv-cache-memory", "512MiB", "--threads", str(args.threads)]
    flags += ["--served-model-name", "m"]
    logs = [args.out.with_name(f"{args.out.stem}.engine{i}.log") for i in range(2)]
    env = thread_env(args.threads)
    with (
        EngineProcess(args.model, logs[0], flags, env=env) as e0,
        EngineProcess(args.model, logs[1], flags, env=env) as e1,
    ):
        bases = [e0.base_url, e1.base_url]
        for base in bases:  # warm up both (first steps are slower)
            asyncio.run(_warm(base, args.sentences))
        return [asyncio.run(run_arm(args, bases, pd, f"r{pd}")) for pd in (False, True)]


async def _warm(base: str, sentences: int) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        await stream_times(client, base, long_prompt("warm", sentences // 4), 4, {})


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(runs))
    stats = [("itl_p50_ms", "p50"), ("itl_p99_ms", "p99"), ("itl_p999_ms", "p99.9")]
    for i, (key, label) in enumerate([*stats, ("itl_max_ms", "max")]):
        ax.bar([x + (i - 1.5) * 0.2 for x in xs], [r[key] for r in runs], 0.2, label=label)
    ax.set_yscale("log")
    ax.set_xticks(list(xs), [r["arm"] for r in runs])
    ax.set_ylabel("inter-token latency of decoding streams (ms)")
    ax.set_title("long prompts arriving while streams decode (2 x 1 thread)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = measure(args)
    colocated, pd = runs
    fields = {
        "model": args.model,
        "engines": 2,
        "threads_per_engine": args.threads,
        "streams": args.streams,
        "long_prompts": args.long_prompts,
        "itl_p99_ratio_colocated_over_pd": colocated["itl_p99_ms"] / pd["itl_p99_ms"],
        "itl_max_ratio_colocated_over_pd": colocated["itl_max_ms"] / pd["itl_max_ms"],
        "runs": runs,
    }
    result = save_result(args.out, "kv_pd", fields, plot)
    for run in runs:
        print(json.dumps({k: v for k, v in run.items() if k != "long_ttfts_s"}))
    ratio = result["itl_p99_ratio_colocated_over_pd"]
    print(json.dumps({"itl_p99_ratio_colocated_over_pd": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
