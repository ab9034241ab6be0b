"""Chargeback conservation over a mixed run with three tenants.

One real engine process (SmolLM2, `--api-key`) is called as the gateway calls it: the engine
key plus the tenant header (`servefleet.api.chargeback.TENANT_HEADER`). Three tenants send
open-loop (Poisson) traffic of different shapes for `--minutes` (default 10), in 40 s on /
20 s off cycles so the replica also idles:

- chat:  short prompts (~30 tokens), 48-token answers, 0.5 requests/s;
- rag:   long prompts (~600 tokens), 8-token answers, 0.15 requests/s;
- batch: ~100-token prompts, 160-token answers, 0.05 requests/s.

/metrics is scraped every 10 s. Reported: the conservation error |sum(busy) + idle - replica
seconds| / replica seconds (over the whole run, and at each scrape), each tenant's share of
busy time and its tokens, and the usage report (`servefleet.api.usage_report`) at example
prices (stated in the JSON). Writes JSON (CPU flags included) and a PNG.

    uv run python -m servefleet.bench.chargeback                 # 10 minutes
    uv run python -m servefleet.bench.chargeback --minutes 2     # a short run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from servefleet.api import chargeback as cb
from servefleet.api.chargeback_spec import HostedPrices, Prices
from servefleet.api.usage_report import TenantTokens, UsageInputs, build_report
from servefleet.bench.bench_output import save_result
from servefleet.bench.engine_process import EngineProcess, thread_env

KEY = "bench-key"
WORDS = [
    "the",
    "ship",
    "logged",
    "crates",
    "of",
    "tea",
    "and",
    "spices",
    "at",
    "the",
    "harbour",
    "before",
    "dawn",
]
EXAMPLE_PRICES = Prices(
    replica_hour=1.0, hosted=HostedPrices(input_per_million=0.15, output_per_million=0.6)
)


@dataclass(frozen=True)
class Tenant:
    name: str
    prompt_words: int
    max_tokens: int
    rate: float  # requests per second while "on"


TENANTS = (
    Tenant("bench/chat", 25, 48, 0.5),
    Tenant("bench/rag", 500, 8, 0.15),
    Tenant("bench/batch", 80, 160, 0.05),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--threads", type=int, default=2, help="--threads of the engine")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--load", type=float, default=1.0, help="multiplies every tenant's rate")
    p.add_argument("--out", type=Path, default=Path("bench/results/chargeback.json"))
    return p.parse_args(argv)


def scrape(base_url: str) -> dict[str, Any]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    busy: dict[str, float] = {}
    tokens: dict[str, dict[str, float]] = {}
    out: dict[str, Any] = {"t": time.monotonic(), "busy": busy, "tokens": tokens}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == cb.ENGINE_BUSY_SECONDS + "_total":
                busy[s.labels[cb.TENANT_LABEL]] = busy.get(s.labels[cb.TENANT_LABEL], 0) + s.value
            elif s.name == cb.ENGINE_ATTRIBUTED_TOKENS + "_total":
                kinds = tokens.setdefault(s.labels[cb.TENANT_LABEL], {})
                kinds[s.labels[cb.KIND_LABEL]] = kinds.get(s.labels[cb.KIND_LABEL], 0) + s.value
            elif s.name == cb.ENGINE_IDLE_SECONDS + "_total":
                out["idle"] = s.value
            elif s.name == cb.ENGINE_REPLICA_SECONDS + "_total":
                out["replica"] = s.value
    out["error"] = abs(sum(busy.values()) + out["idle"] - out["replica"]) / out["replica"]
    return out


async def tenant_traffic(
    client: httpx.AsyncClient,
    tenant: Tenant,
    end: float,
    rng: random.Random,
    used: dict[str, Any],
    load: float,
) -> None:
    tasks: list[asyncio.Task[None]] = []
    started = time.monotonic()

    async def one(i: int) -> None:
        words = " ".join(rng.choice(WORDS) for _ in range(tenant.prompt_words))
        body = {"model": "m", "prompt": f"{i}: {words}", "max_tokens": tenant.max_tokens,
                "ignore_eos": True, "temperature": 0.8}  # fmt: skip
        headers = {"authorization": f"Bearer {KEY}", cb.TENANT_HEADER: tenant.name}
        try:
            r = await client.post("/v1/completions", json=body, headers=headers)
        except httpx.HTTPError:
            used["failed"] += 1
            return
        if r.status_code == 200:
            usage = r.json()["usage"]
            used["prompt"] += usage["prompt_tokens"]
            used["completion"] += usage["completion_tokens"]
            used["ok"] += 1
        else:
            used["failed"] += 1

    i = 0
    while (now := time.monotonic()) < end:
        on = (now - started) % 60 < 40
        await asyncio.sleep(rng.expovariate(tenant.rate * load))
        if on and time.monotonic() < end:
            tasks.append(asyncio.create_task(one(i)))
            i += 1
    await asyncio.gather(*tasks)


async def drive(base_url: str, minutes: float, seed: int, load: float) -> dict[str, Any]:
    rng = random.Random(seed)
    used = {t.name: {"prompt": 0, "completion": 0, "ok": 0, "failed": 0} for t in TENANTS}
    scrapes = [scrape(base_url)]
    end = time.monotonic() + minutes * 60
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        traffic = asyncio.gather(
            *(tenant_traffic(client, t, end, rng, used[t.name], load) for t in TENANTS)
        )
        while not traffic.done():
            await asyncio.wait([traffic], timeout=10)
            scrapes.append(scrape(base_url))
        await traffic
    await asyncio.sleep(2)  # some idle after the last answer
    scrapes.append(scrape(base_url))
    return {"used": used, "scrapes": scrapes}


def summarise(raw: dict[str, Any], minutes: float) -> dict[str, Any]:
    first, last = raw["scrapes"][0], raw["scrapes"][-1]
    busy = {t: last["busy"].get(t, 0.0) - first["busy"].get(t, 0.0) for t in last["busy"]}
    idle, replica = last["idle"] - first["idle"], last["replica"] - first["replica"]
    busy_total = sum(busy.values())
    inputs = UsageInputs(
        busy_seconds=busy,
        idle_seconds=idle,
        replica_seconds=replica,
        tokens={
            t: TenantTokens(prompt=u["prompt"], completion=u["completion"])
            for t, u in raw["used"].items()
        },
    )
    report = build_report(inputs, EXAMPLE_PRICES, cb.IdlePolicy.SHARED, ("start", "end"))
    return {
        "minutes": minutes,
        "replica_seconds": replica,
        "busy_seconds": busy_total,
        "idle_seconds": idle,
        "conservation_error": abs(busy_total + idle - replica) / replica,
        "conservation_error_max_over_scrapes": max(s["error"] for s in raw["scrapes"]),
        "busy_share": {t: b / busy_total for t, b in busy.items()},
        "busy_seconds_by_tenant": busy,
        "client_tokens": raw["used"],
        "engine_tokens": last["tokens"],
        "example_prices": EXAMPLE_PRICES.model_dump(),
        "report_shared_idle": report.model_dump(mode="json"),
    }


def plot(raw: dict[str, Any], run: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scrapes = raw["scrapes"]
    t0 = scrapes[0]["t"]
    xs = [(s["t"] - t0) / 60 for s in scrapes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    base = [0.0] * len(scrapes)
    names = sorted({t for s in scrapes for t in s["busy"]})
    for name in names:
        ys = [s["busy"].get(name, 0.0) - scrapes[0]["busy"].get(name, 0.0) for s in scrapes]
        top = [b + y for b, y in zip(base, ys, strict=True)]
        left.fill_between(xs, base, top, label=f"busy {name}", alpha=0.7)
        base = top
    idle_top = [b + s["idle"] - scrapes[0]["idle"] for b, s in zip(base, scrapes, strict=True)]
    left.fill_between(xs, base, idle_top, label="idle", color="#ccc")
    left.plot(xs, [s["replica"] - scrapes[0]["replica"] for s in scrapes], "k--",
              label="replica seconds")  # fmt: skip
    left.set_xlabel("minutes")
    left.set_ylabel("seconds (cumulative)")
    left.legend(fontsize=7)
    left.set_title("busy by tenant + idle vs replica seconds", fontsize=9)
    right.plot(xs, [s["error"] * 100 for s in scrapes], "o-")
    right.axhline(1.0, color="r", ls=":", label="1 % bound")
    right.set_xlabel("minutes")
    right.set_ylabel("conservation error at scrape (%)")
    right.legend()
    right.set_title(f"whole run: {run['conservation_error'] * 100:.3f} %", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    flags = ["--api-key", KEY, "--threads", str(args.threads), "--served-model-name", "m"]
    flags += ["--kv-cache-memory", "512MiB"]
    log = args.out.with_suffix(".engine.log")
    with EngineProcess(args.model, log, flags, env=thread_env(args.threads)) as engine:
        raw = asyncio.run(drive(engine.base_url, args.minutes, args.seed, args.load))
    run = summarise(raw, args.minutes)
    fields = {
        "model": args.model,
        "threads": args.threads,
        "load": args.load,
        "tenants": [t.__dict__ for t in TENANTS],
        "run": run,
        "scrapes": raw["scrapes"],
    }
    save_result(args.out, "chargeback", fields, lambda _, png: plot(raw, run, png))
    print(json.dumps({k: v for k, v in run.items() if k != "report_shared_idle"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
