"""LoRA cold start through the gateway: time to first token for an adapter no replica holds
(the gateway loads it on demand, then the request runs) against the same adapter once
loaded, and against the base model, same prompt, same run.

One engine with `--max-loras 2` behind an in-process gateway that knows `--adapters`
adapters (real PEFT adapters, `make_adapters.random_adapter`, rank `--rank`, all seven
projections). Each adapter is asked once cold, then `--repeats` times warm; going through
them evicts the first ones, so a second round measures a cold start after an eviction.
Writes JSON and a PNG, with the CPU's flags.

    uv run python -m servefleet.bench.lora_cold_load            # ~2 minutes here
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from servefleet.bench.bench_output import save_result
from servefleet.bench.engine_process import EngineProcess, thread_env
from servefleet.bench.lora_throughput import make_adapters
from servefleet.bench.processes import serve_in_thread

KEY = "bench-key"
PROMPT = "Name three rivers of Europe and one fact about each."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4, help="more than --max-loras 2: evictions")
    p.add_argument("--repeats", type=int, default=3, help="warm requests per adapter")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the engine")
    p.add_argument("--adapter-dir", type=Path, default=Path("bench/results/lora_adapters"))
    p.add_argument("--out", type=Path, default=Path("bench/results/lora_cold_load.json"))
    return p.parse_args(argv)


def gateway_for(model: str, engine_url: str, paths: list[Path]) -> Any:
    from servefleet.api.gateway_config import (
        ApiKeyRef,
        GatewayAdapter,
        GatewayConfig,
        GatewayDeployment,
        GatewayTenant,
        TenantAccess,
        hash_api_key,
    )
    from servefleet.gateway.app import Gateway

    adapters = [GatewayAdapter(name=f"lora-{i}", path=str(p)) for i, p in enumerate(paths)]
    config = GatewayConfig(
        internal_port=None,
        tenants=[GatewayTenant(name="bench", api_keys=[ApiKeyRef(sha256=hash_api_key(KEY))])],
        deployments=[
            GatewayDeployment(
                name="pool", model=model, tenants=[TenantAccess(name="bench")], adapters=adapters
            )
        ],
    )
    gateway = Gateway(config)
    gateway.set_replicas("pool", [engine_url], ready=[engine_url])
    return gateway


_asked = iter(range(1 << 30))


async def ttft(client: httpx.AsyncClient, base: str, model: str) -> float:
    """Seconds from sending a streamed chat to its first content token. Every prompt starts
    differently, so no request finds its prompt in the prefix cache: cold and warm differ by
    the load alone."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Question {next(_asked)}. {PROMPT}"}],
        "max_tokens": 8,
        "stream": True,
        "temperature": 0,
    }
    started = time.perf_counter()
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                return time.perf_counter() - started
    raise RuntimeError(f"{model}: no token came back")


async def measure_all(base: str, model: str, count: int, repeats: int) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=300, headers=headers) as client:
        for _ in range(3):  # warm-up: the engine's first steps are slower
            await ttft(client, base, model)
        base_ttft: list[float] = []
        rounds: list[dict[str, Any]] = []
        for round_index in range(2):  # the second round finds each adapter evicted
            for i in range(count):
                name = f"lora-{i}"
                first = await ttft(client, base, name)
                again = [await ttft(client, base, name) for _ in range(repeats)]
                rounds.append({"round": round_index, "adapter": name, "cold": first, "warm": again})
                base_ttft.append(await ttft(client, base, model))  # the base, in between
    cold = [r["cold"] for r in rounds]
    warm = [w for r in rounds for w in r["warm"]]
    return {
        "base_ttft_p50_s": statistics.median(base_ttft),
        "cold_ttft_p50_s": statistics.median(cold),
        "warm_ttft_p50_s": statistics.median(warm),
        "cold_minus_warm_p50_s": statistics.median(cold) - statistics.median(warm),
        "requests": rounds,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["base model", "adapter loaded", "adapter cold"]
    keys = ["base_ttft_p50_s", "warm_ttft_p50_s", "cold_ttft_p50_s"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, [result[k] * 1000 for k in keys], color=["#777", "#3a7", "#c73"])
    ax.set_ylabel("time to first token, p50 (ms)")
    ax.set_title(f"LoRA cold load through the gateway, rank {result['rank']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    paths = make_adapters(args.adapter_dir, args.adapters, args.rank)
    log = args.out.with_name(f"{args.out.stem}.engine.log")
    flags = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", str(args.rank)]
    with EngineProcess(args.model, log, flags, env=thread_env(args.threads)) as engine:
        gateway = gateway_for(args.model, engine.base_url, paths)
        with serve_in_thread(gateway) as base:
            measured = asyncio.run(measure_all(base, args.model, args.adapters, args.repeats))
    result = {
        "model": args.model,
        "rank": args.rank,
        "max_loras": 2,
        **measured,
    }
    result = save_result(args.out, "lora_cold_load", result, plot)
    print(json.dumps({k: v for k, v in result.items() if k not in ("cpu_flags", "requests")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
