"""LoRA throughput: c=16 with 1, 4, 8 and 16 distinct adapters in the mix against the base
model alone, one engine, same prompts, same run (goal: >= 0.8x the base with 8 adapters).

Real PEFT adapters are made first (`make_adapters.random_adapter`, rank `--rank`, all seven
projections) and loaded through vLLM's `/v1/load_lora_adapter`; request i of a mix of k
adapters names adapter i mod k. Each mix runs the same completions (random-word prompts of
`--input-words`, `--output-tokens` tokens each, ignore_eos), fresh words for every mix of
every round so no mix finds another's prompts in the prefix cache.

Steady state first: `--warmup-requests` fresh prompts (default 96, over every adapter and the
base) go through before anything is timed, more tokens than the KV cache holds, so no timed
mix meets a cold engine or an empty cache (without it, the first mix of a fresh engine ran
at 104 tok/s against 185-198 in later rounds, and whichever mix came first paid for it).
`--rounds N` runs all mixes N times, each round in a rotated order (round r starts at mix
r), and the headline ratio of a mix is the median over rounds of its throughput over the
base's in the same round: the machine's speed drifts by 10-20% over minutes here, in both
directions, and a ratio taken within a round cancels most of it. Each mix's best round is
kept too, and the engine's CPU seconds per mix: with `--threads 1`, output tokens per engine
CPU-second is a ratio that other work on the machine barely moves. Also measured: an
adapter's load time through the endpoint. Writes JSON and a PNG, with the CPU's flags.

    uv run python -m servefleet.bench.lora_throughput                       # ~6 minutes here
    SERVEFLEET_MATMUL_ISA=avx2 uv run python -m servefleet.bench.lora_throughput
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from servefleet.bench.bench_output import save_result
from servefleet.bench.engine_process import EngineProcess, thread_env

MIXES = (0, 1, 4, 8, 16)  # distinct adapters in the mix; 0: the base model alone


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=32, help="per mix")
    p.add_argument("--input-words", type=int, default=100)
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the engine")
    p.add_argument("--rounds", type=int, default=3, help="all mixes this many times, rotated")
    p.add_argument("--warmup-requests", type=int, default=96, help="untimed, fill the KV cache")
    p.add_argument("--adapters", type=Path, default=Path("bench/results/lora_adapters"))
    p.add_argument("--out", type=Path, default=Path("bench/results/lora_throughput.json"))
    return p.parse_args(argv)


def make_adapters(root: Path, count: int, rank: int) -> list[Path]:
    """Random PEFT adapters (reused when present: they take seconds each to make)."""
    from servefleet.bench.make_adapters import random_adapter

    paths = []
    for index in range(count):
        directory = root / f"r{rank}-{index}"
        if not (directory / "adapter_model.safetensors").is_file():
            random_adapter(directory, seed=1000 + index, rank=rank)
        paths.append(directory.resolve())
    return paths


def prompts(count: int, words: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    vocab = [
        "river",
        "stone",
        "light",
        "paper",
        "window",
        "garden",
        "music",
        "silver",
        "orange",
        "cloud",
        "table",
    ]
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(count)]


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds a process (all its threads) has used (Linux; else None)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


async def run_mix(
    url: str,
    models: list[str],
    texts: list[str],
    concurrency: int,
    output_tokens: int,
    pid: int | None = None,
) -> dict[str, Any]:
    """All `texts` as completions, request i under models[i % len(models)], `concurrency`
    at a time; output tokens per second over the whole mix, and per CPU-second of engine
    process `pid`."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(texts)):
        queue.put_nowait(index)
    tokens, failed = 0, 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens, failed
        while not queue.empty():
            index = queue.get_nowait()
            body = {"model": models[index % len(models)], "prompt": texts[index],
                    "max_tokens": output_tokens, "ignore_eos": True, "temperature": 0}  # fmt: skip
            response = await client.post(f"{url}/v1/completions", json=body, timeout=900)
            if response.status_code != 200:
                failed += 1
                continue
            tokens += response.json()["usage"]["completion_tokens"]

    started, cpu_before = time.monotonic(), cpu_seconds(pid)
    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    seconds, cpu_after = time.monotonic() - started, cpu_seconds(pid)
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return {"output_tokens": tokens, "seconds": seconds, "output_tps": tokens / seconds,
            "engine_cpu_seconds": cpu, "output_per_cpu_second": tokens / cpu if cpu else None,
            "failed": failed}  # fmt: skip


def load_all(url: str, paths: list[Path]) -> list[float]:
    """Load every adapter through the endpoint; seconds per load."""
    seconds = []
    for index, path in enumerate(paths):
        started = time.monotonic()
        response = httpx.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": f"lora-{index}", "lora_path": str(path)},
            timeout=300,
        )
        response.raise_for_status()
        seconds.append(time.monotonic() - started)
    return seconds


def measure(args: argparse.Namespace, paths: list[Path]) -> dict[str, Any]:
    log = args.out.with_name(f"{args.out.stem}.engine.log")
    flags = ["--enable-lora", "--max-loras", str(max(MIXES)), "--max-lora-rank", str(args.rank),
             "--max-num-seqs", str(args.concurrency)]  # fmt: skip
    with EngineProcess(args.model, log, flags, env=thread_env(args.threads)) as engine:
        url = engine.base_url
        load_seconds = load_all(url, paths)
        warm = prompts(args.warmup_requests, args.input_words, seed=1)
        every = [args.model] + [f"lora-{i}" for i in range(max(MIXES))]
        asyncio.run(run_mix(url, every, warm, args.concurrency, args.output_tokens))
        rounds: dict[str, list[dict[str, Any]]] = {str(count): [] for count in MIXES}
        for round_ in range(args.rounds):
            for count in MIXES[round_ % len(MIXES) :] + MIXES[: round_ % len(MIXES)]:
                models = [f"lora-{i}" for i in range(count)] or [args.model]
                fresh = prompts(args.requests, args.input_words, seed=1000 * (round_ + 1) + count)
                mix = run_mix(url, models, fresh, args.concurrency, args.output_tokens, engine.pid)
                rounds[str(count)].append(asyncio.run(mix))
    base_tps = [r["output_tps"] for r in rounds["0"]]
    mixes = {
        count: {**max(runs, key=lambda r: r["output_tps"]),
                "rounds_tps": [r["output_tps"] for r in runs],
                "round_ratios": [r["output_tps"] / b for r, b in zip(runs, base_tps, strict=True)],
                "best_per_cpu_second": max(r["output_per_cpu_second"] or 0.0 for r in runs),
                "failed": sum(r["failed"] for r in runs)}
        for count, runs in rounds.items()
    }  # fmt: skip
    return {"load_seconds": load_seconds, "mixes": mixes}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = result["mixes"]
    labels = ["base" if k == "0" else f"{k} adapters" for k in mixes]
    values = [m["output_tps"] for m in mixes.values()]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, values, color=["#777"] + ["#3a7"] * (len(values) - 1))
    ax.set_ylabel("output tokens/s (c=16)")
    ax.set_title(f"LoRA mixes vs the base model, rank {result['rank']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    paths = make_adapters(args.adapters, max(MIXES), args.rank)
    measured = measure(args, paths)
    base = measured["mixes"]["0"]["output_tps"]
    result = {
        "model": args.model,
        "rank": args.rank,
        "concurrency": args.concurrency,
        "requests_per_mix": args.requests,
        "rounds": args.rounds,
        "threads": args.threads,
        "ratio_to_base": {
            k: statistics.median(m["round_ratios"]) for k, m in measured["mixes"].items()
        },
        "best_round_ratio_to_base": {
            k: m["output_tps"] / base for k, m in measured["mixes"].items()
        },
        "cpu_ratio_to_base": {
            k: m["best_per_cpu_second"] / (measured["mixes"]["0"]["best_per_cpu_second"] or 1.0)
            for k, m in measured["mixes"].items()
        },
        **measured,
    }
    result = save_result(args.out, "lora_throughput", result, plot)
    print(json.dumps({k: v for k, v in result.items() if k != "cpu_flags"}, indent=2))
    failed = sum(m["failed"] for m in measured["mixes"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
