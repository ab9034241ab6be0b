"""Prefix affinity vs least-load alone: 2 real engine replicas behind the gateway.

The workload is several distinct system prompts (~600-900 tokens each); every request is one
of them plus a short unique question, in a seeded shuffled order, sent by a closed-loop client
through `servefleet gateway`. The run is done twice on fresh engines (cold caches): once with
prefix affinity (`routing.affinityBlocks` = 4) and once with least-load only (0). Reported for
both: the engines' prefix-cache hit rate (deltas of `vllm:prefix_cache_hits_total` /
`vllm:prefix_cache_queries_total`), client TTFT p50/p99 through the gateway, and the ratios.

Each replica's KV cache is sized to hold most, not all, of the system prompts: with affinity a
replica only needs its share of them; with least-load both replicas see every prompt. Before
measuring, each system prompt is sent once (one at a time) under the run's routing, so what is
compared is the steady state rather than who pays the very first prefill.

    uv run python bench/gateway_affinity.py            # quick mode (a few minutes)
    uv run python bench/gateway_affinity.py --full     # more prompts and rounds

Prints one JSON summary and writes JSON + PNG (default: bench/results/gateway_affinity.*).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    RoutingConfig,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.llmdeployment import AdmissionSpec, PoolSpec
from servefleet.bench.client import BenchClient, ClientConfig, Endpoint, make_http_client
from servefleet.bench.engine_process import EngineProcess
from servefleet.bench.processes import free_port, servefleet_command
from servefleet.bench.workloads import Prompt

MODEL = "smollm2-135m-instruct"
API_KEY = "sk-bench"
_WORD_TEXT = (
    "account adjust answer archive balance billing branch budget careful client clause "
    "compliance contract courier customer deadline delivery deposit detail document escalate "
    "estimate exchange expense feature formal freight guarantee handle history invoice ledger "
    "license limit manual meeting network notice order partner payment policy premium priority "
    "product quarter receipt record refund region release renewal report request resolve "
    "review schedule service shipment signature standard status storage summary support "
    "survey system ticket transfer update upgrade urgent vendor verify warranty warehouse"
)
WORDS = _WORD_TEXT.split()
TOPICS = (
    "travel insurance",
    "cloud billing",
    "warehouse logistics",
    "medical appointments",
    "software licensing",
    "bank transfers",
    "hotel bookings",
    "car rentals",
    "school admissions",
    "energy contracts",
)


class ModeResult(BaseModel):
    mode: str
    requests: int
    failed: int
    prefix_cache_hit_rate: float
    prefix_cache_hits: int
    prefix_cache_queries: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    served_per_replica: list[int]
    wall_s: float


def system_prompts(count: int, seed: int) -> list[str]:
    """Distinct from their first words on (each opens with its own topic), 450-650 words."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        rules = [f"You are the {topic} assistant number {i} of the company."]
        words = 0
        target = rng.randint(450, 650)
        n = 0
        while words < target:
            n += 1
            body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 14)))
            rules.append(f"Rule {n} for {topic}: {body}.")
            words += len(rules[-1].split())
        prompts.append(" ".join(rules))
    return prompts


def workload(num_prompts: int, rounds: int, seed: int) -> list[Prompt]:
    systems = system_prompts(num_prompts, seed)
    order = [i for i in range(num_prompts) for _ in range(rounds)]
    random.Random(seed + 1).shuffle(order)
    return [
        Prompt(
            system_text=systems[p],
            text=f"Question {q}: what is {q} plus {p}?",
            num_tokens=len(systems[p].split()) * 4 // 3,
            prefix_index=p,
        )
        for q, p in enumerate(order)
    ]


def engine_counters(url: str) -> tuple[int, int]:
    text = httpx.get(url + "/metrics", timeout=10).text

    def value(name: str) -> int:
        found = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        if found is None:
            raise RuntimeError(f"{url}/metrics has no {name}")
        return int(float(found.group(1)))

    return value("vllm:prefix_cache_hits_total"), value("vllm:prefix_cache_queries_total")


def gateway_config(endpoints: list[str], affinity_blocks: int, port: int) -> GatewayConfig:
    return GatewayConfig(
        host="127.0.0.1",
        port=port,
        internal_port=None,  # nothing here reads /metrics or /internal/*
        tenants=[GatewayTenant(name="bench", api_keys=[ApiKeyRef(sha256=hash_api_key(API_KEY))])],
        deployments=[
            GatewayDeployment(
                name="smollm2",
                model=MODEL,
                endpoints=endpoints,
                pool=PoolSpec(per_replica_concurrency=4),
                admission=AdmissionSpec(max_queue_depth=256, max_queue_wait=600),
                tenants=[TenantAccess(name="bench")],
                upstream_timeout_seconds=600,
            )
        ],
        routing=RoutingConfig(affinity_blocks=affinity_blocks),
    )


def run_mode(
    mode: str, prompts: list[Prompt], args: argparse.Namespace, logs: Path
) -> tuple[ModeResult, list[float]]:
    engine_args = [
        "--max-num-seqs",
        "4",
        "--threads",
        "1",
        "--kv-cache-memory",
        args.kv_cache,
    ]
    engines = [
        EngineProcess(MODEL, logs / f"{mode}-engine-{i}.log", engine_args, ready_timeout_s=600)
        for i in range(2)
    ]
    gateway: subprocess.Popen[bytes] | None = None
    try:
        # Both load side by side; each waits for its own /ready.
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(EngineProcess.__enter__, engines))
        port = free_port()
        config_path = logs / f"{mode}-gateway.json"
        config = gateway_config([e.base_url for e in engines], 4 if mode == "affinity" else 0, port)
        config_path.write_text(config.model_dump_json(by_alias=True, exclude_none=True))
        with (logs / f"{mode}-gateway.log").open("wb") as out:
            gateway = subprocess.Popen(
                [*servefleet_command(), "gateway", "--config", str(config_path)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        base = f"http://127.0.0.1:{port}"
        _wait_gateway(base, gateway)
        # Warm-up, not measured: each system prompt once, one at a time, under this run's
        # routing. What is measured is the steady state, not who pays the first prefill.
        warm = {p.prefix_index or 0: p for p in prompts}
        args_one = argparse.Namespace(**{**vars(args), "concurrency": 1})
        asyncio.run(_send(base, [warm[i] for i in sorted(warm)], args_one))
        before = [engine_counters(e.base_url) for e in engines]
        served_before = _served(base)
        t0 = time.monotonic()
        results = asyncio.run(_send(base, prompts, args))
        wall = time.monotonic() - t0
        after = [engine_counters(e.base_url) for e in engines]
        served = [a - b for a, b in zip(_served(base), served_before, strict=True)]
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=30)
        for engine in engines:
            engine.stop(grace_s=10)
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    ok = [r for r in results if r.ok]
    ttfts = sorted(t * 1000 for r in ok if (t := r.ttft) is not None)
    if not ttfts:
        raise RuntimeError(f"{mode}: no request succeeded: {results[0].error}")
    return ModeResult(
        mode=mode,
        requests=len(results),
        failed=len(results) - len(ok),
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        prefix_cache_hits=hits,
        prefix_cache_queries=queries,
        ttft_p50_ms=statistics.median(ttfts),
        ttft_p99_ms=_percentile(ttfts, 0.99),
        served_per_replica=served,
        wall_s=wall,
    ), ttfts


def _served(base: str) -> list[int]:
    stats = httpx.get(base + "/internal/deployments", timeout=10).json()[0]
    return [int(r["served"]) for r in stats["replicas"]]


def _wait_gateway(base: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode}")
        try:
            stats = httpx.get(base + "/internal/deployments", timeout=5).json()
            if stats[0]["ready_replicas"] == 2:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the gateway did not see both replicas ready")


async def _send(base: str, prompts: list[Prompt], args: argparse.Namespace) -> list[Any]:
    config = ClientConfig(
        url=base,
        model=MODEL,
        endpoint=Endpoint.CHAT,
        concurrency=args.concurrency,
        output_tokens=args.output_tokens,
        api_key=API_KEY,
        request_timeout_s=600,
    )
    async with make_http_client(config) as http:
        return await BenchClient(config, http).run(prompts)


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true", help="more prompts and rounds")
    parser.add_argument("--system-prompts", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="requests per system prompt")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument(
        "--kv-cache",
        default="160MiB",
        help="KV cache per replica (the default holds ~2/3 of the quick run's system prompts)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/gateway_affinity.json")
    args = parser.parse_args()
    num_prompts = args.system_prompts or (8 if args.full else 6)
    rounds = args.rounds or (12 if args.full else 5)
    prompts = workload(num_prompts, rounds, args.seed)
    out = Path(args.out)
    logs = Path(tempfile.mkdtemp(prefix="gateway-affinity-"))
    print(f"engine and gateway logs: {logs}", file=sys.stderr)
    modes: dict[str, ModeResult] = {}
    samples: dict[str, list[float]] = {}
    for mode in ("affinity", "least_load"):
        modes[mode], samples[mode] = run_mode(mode, prompts, args, logs)
    aff, least = modes["affinity"], modes["least_load"]
    summary = {
        "benchmark": "gateway_affinity",
        "parameters": {
            "replicas": 2,
            "system_prompts": num_prompts,
            "requests": len(prompts),
            "concurrency": args.concurrency,
            "output_tokens": args.output_tokens,
            "kv_cache_per_replica": args.kv_cache,
            "seed": args.seed,
        },
        "affinity": aff.model_dump(),
        "least_load": least.model_dump(),
        "hit_rate_affinity_over_least_load": _ratio(
            aff.prefix_cache_hit_rate, least.prefix_cache_hit_rate
        ),
        "ttft_p50_least_load_over_affinity": _ratio(least.ttft_p50_ms, aff.ttft_p50_ms),
        "ttft_p99_least_load_over_affinity": _ratio(least.ttft_p99_ms, aff.ttft_p99_ms),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    _plot(modes, samples, out.with_suffix(".png"))
    print(json.dumps(summary))
    return 0


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _plot(modes: dict[str, ModeResult], samples: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = list(modes)
    left.bar(names, [modes[m].prefix_cache_hit_rate * 100 for m in names], color=["C0", "C1"])
    left.set_ylabel("prefix-cache hit rate (%)")
    left.set_ylim(0, 100)
    for i, m in enumerate(names):
        left.text(
            i,
            modes[m].prefix_cache_hit_rate * 100 + 2,
            f"{modes[m].prefix_cache_hit_rate:.0%}",
            ha="center",
        )
    for m in names:
        xs = samples[m]
        right.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=m)
    right.set_xlabel("TTFT through the gateway (ms)")
    right.set_ylabel("fraction of requests")
    right.set_xscale("log")
    right.legend()
    fig.suptitle("prefix affinity vs least-load: 2 replicas, multi-system-prompt workload")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
