"""A long prompt arriving while streams decode: the decoding streams' inter-token latency
during its prefill, and its TTFT, with prompt chunks sized to a step-time target
(`--max-decode-step-ms auto`) against today's fixed budget (`--max-num-batched-tokens`
chunks).

Two real engine processes, one thread each, started together and measured in turn, round
after round, in the same run (so both see the same machine load). In a round, `--streams`
short-prompt streams decode; once all decode, the long prompt (~1,500 tokens, starting
differently every round, prefix caching off) arrives. The ITL samples are the streams'
token gaps that end between its arrival and its first token; the streams are cancelled
once it has answered. One unmeasured round per engine first warms it up (and trains the
adaptive engine's step-cost model). Writes JSON (CPU flags, the adaptive engine's fitted
step-cost coefficients and last chosen chunk) and a PNG.

    uv run python -m servefleet.bench.prefill_itl        # ~2-4 minutes here
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

from servefleet.api.step_cost import PROMPT_CHUNK_METRIC, STEP_COST_METRIC
from servefleet.bench.bench_output import save_result
from servefleet.bench.engine_process import EngineProcess, thread_env
from servefleet.bench.kv_pd import AUTH, KEY, long_prompt
from servefleet.bench.report import percentile

ARMS = ("fixed", "adaptive")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--streams", type=int, default=4, help="decoding streams")
    p.add_argument("--sentences", type=int, default=76, help="~20 tokens each: ~1,500 tokens")
    p.add_argument("--rounds", type=int, default=2, help="measured rounds per arm")
    p.add_argument("--target", default="auto", help="--max-decode-step-ms of the adaptive arm")
    p.add_argument("--out", type=Path, default=Path("bench/results/prefill_itl.json"))
    return p.parse_args(argv)


async def stream_into(
    client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int, times: list[float]
) -> None:
    """Appends the arrival time of each streamed token (one event per step here)."""
    body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", base + "/v1/completions", json=body, headers=AUTH) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())


Round = tuple[list[float], float, list[tuple[float, float]]]


async def one_round(
    client: httpx.AsyncClient, base: str, tag: str, args: argparse.Namespace
) -> Round:
    """(ITL samples in seconds that end during the prefill, TTFT seconds, stream times)."""
    streams: list[list[float]] = [[] for _ in range(args.streams)]
    tasks = [
        asyncio.create_task(stream_into(client, base, f"Story {tag} {i}: once", 4000, t))
        for i, t in enumerate(streams)
    ]
    while not all(len(t) >= 3 for t in streams):  # every stream decodes
        await asyncio.sleep(0.01)
    arrival = time.perf_counter()
    first: list[float] = []
    await stream_into(client, base, long_prompt(tag, args.sentences), 1, first)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    itls = [b - a for t in streams for a, b in itertools.pairwise(t) if arrival < b <= first[0]]
    timeline = [(b - arrival, b - a) for t in streams for a, b in itertools.pairwise(t)]
    return itls, first[0] - arrival, timeline


def summarise(arm: str, rounds: list[Round]) -> dict[str, Any]:
    itls = [x * 1000 for r in rounds for x in r[0]]
    return {
        "arm": arm,
        "itl_p50_ms": percentile(itls, 50),
        "itl_p99_ms": percentile(itls, 99),
        "itl_max_ms": max(itls),
        "itl_samples": len(itls),
        "long_ttft_ms": statistics.median(r[1] * 1000 for r in rounds),
        "long_ttfts_ms": [r[1] * 1000 for r in rounds],
        "timeline": [[round(t, 4), round(x * 1000, 2)] for t, x in rounds[-1][2]],
    }


async def measure_async(args: argparse.Namespace, bases: dict[str, str]) -> dict[str, Any]:
    rounds: dict[str, list[Round]] = {arm: [] for arm in ARMS}
    async with httpx.AsyncClient(timeout=900) as client:
        for arm, base in bases.items():  # warm-up: not measured
            await one_round(client, base, f"warm-{arm}", args)
        for k in range(args.rounds):
            for arm, base in bases.items():
                rounds[arm].append(await one_round(client, base, f"{arm}-{k}", args))
        tokenized = await client.post(
            bases["fixed"] + "/tokenize",
            json={"model": "m", "prompt": long_prompt("fixed-0", args.sentences)},
            headers=AUTH,
        )
        metrics = (await client.get(bases["adaptive"] + "/metrics")).text
    return {
        "prompt_tokens": tokenized.json()["count"],
        "runs": [summarise(arm, rounds[arm]) for arm in ARMS],
        "adaptive_engine": scraped(metrics),
    }


def scraped(text: str) -> dict[str, float]:
    """The adaptive engine's step-cost coefficients and last chosen chunk."""
    out = {}
    for line in text.splitlines():
        if line.startswith((STEP_COST_METRIC, PROMPT_CHUNK_METRIC)):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--api-key", KEY, "--threads", "1", "--served-model-name", "m"]
    flags += ["--no-prefix-caching", "--kv-cache-memory", "512MiB"]
    logs = {arm: args.out.with_name(f"{args.out.stem}.{arm}.log") for arm in ARMS}
    env = thread_env(1)
    with (
        EngineProcess(args.model, logs["fixed"], flags, env=env) as fixed,
        EngineProcess(
            args.model, logs["adaptive"], [*flags, "--max-decode-step-ms", args.target], env=env
        ) as adaptive,
    ):
        return asyncio.run(
            measure_async(args, {"fixed": fixed.base_url, "adaptive": adaptive.base_url})
        )


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    for run in result["runs"]:
        ts = [t for t, _ in run["timeline"]]
        ax.plot(ts, [x for _, x in run["timeline"]], ".", ms=3, label=run["arm"])
        ax.axvline(run["long_ttfts_ms"][-1] / 1000, ls="--", lw=0.8, color=ax.lines[-1].get_color())
    ax.set_xlim(-1, None)
    ax.set_xlabel("seconds since the long prompt arrived (dashed: its first token)")
    ax.set_ylabel("decoding streams' ITL (ms)")
    ax.set_title(
        f"{result['prompt_tokens']}-token prompt beside {result['streams']} streams (last round)"
    )
    ax.legend()
    keys = ("itl_p50_ms", "itl_p99_ms", "itl_max_ms", "long_ttft_ms")
    width = 0.38
    for i, run in enumerate(result["runs"]):
        bx.bar(
            [k + i * width for k in range(len(keys))],
            [run[k] for k in keys],
            width,
            label=run["arm"],
        )
    bx.set_xticks(
        [k + width / 2 for k in range(len(keys))], ["ITL p50", "ITL p99", "ITL max", "TTFT"]
    )
    bx.set_yscale("log")
    bx.set_ylabel("ms")
    bx.set_title("under load (shared 2-core CPU), 1 thread/engine")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    measured = measure(args)
    fixed, adaptive = measured["runs"]
    fields = {
        "conditions": "measured under load (machine shared with other work): compare ratios",
        "model": args.model,
        "streams": args.streams,
        "rounds_per_arm": args.rounds,
        "adaptive_target": args.target,
        "threads_per_engine": 1,
        **measured,
        "itl_p99_ratio_adaptive_over_fixed": adaptive["itl_p99_ms"] / fixed["itl_p99_ms"],
        "itl_max_ratio_adaptive_over_fixed": adaptive["itl_max_ms"] / fixed["itl_max_ms"],
        "ttft_ratio_adaptive_over_fixed": adaptive["long_ttft_ms"] / fixed["long_ttft_ms"],
    }
    result = save_result(args.out, "prefill_itl", fields, plot)
    for run in result["runs"]:
        print(json.dumps({k: v for k, v in run.items() if k != "timeline"}))
    print(json.dumps({k: v for k, v in result.items() if "ratio" in k or k == "adaptive_engine"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
