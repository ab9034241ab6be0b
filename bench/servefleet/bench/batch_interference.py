"""A batch on spare capacity: interactive TTFT with and without a running batch, the batch's
completion time, and how much of the pool the batch fills (`servefleet up`, the real model).

    python -m servefleet.bench.batch_interference --lines 1000
    python -m servefleet.bench.batch_interference --lines 200 --window 30   # shorter

Two tenants on one deployment: `live` streams chats from `--clients` loops (TTFT measured per
request, `--think` seconds between a loop's requests), `bulk` submits `--lines` chat lines as a
batch. First `--window` seconds of `live` alone, then the same with the batch running; then
the batch is waited for. The deployment reserves one slot per live client
(`admission.interactiveReservedSlots`). Goal from the issue: TTFT p99 with the batch within
10 % of without; the pool's utilisation (engine busy / alive seconds) in both windows shows
the idle time the batch fills. Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from servefleet.bench.bench_output import save_result
from servefleet.bench.chargeback import scrape
from servefleet.bench.soak_up import UpProcess
from servefleet.bench.soak_up_probe import ProcessTree

MODEL = "smollm2-135m-instruct"
KEYS = {"live": "sk-live-bench", "bulk": "sk-bulk-bench"}
# The interactive reserve matches the live clients: each finds a slot batch lines leave free.
MANIFEST = """
apiVersion: servefleet.io/v1alpha1
kind: LLMDeployment
metadata: {{name: bench}}
spec:
  model: {{name: {model}, source: {{builtin: {model}}}}}
  engine: {{maxNumSeqs: 4}}
  pool: {{minReplicas: 1, maxReplicas: 1, perReplicaConcurrency: 4}}
  admission: {{interactiveReservedSlots: {reserve}}}
  autoscaling: {{enabled: false}}
  tenants:
    - {{name: live, apiKeySecretRef: {{name: keys, key: live}}}}
    - {{name: bulk, apiKeySecretRef: {{name: keys, key: bulk}}, trafficClass: batch}}
---
apiVersion: v1
kind: Secret
metadata: {{name: keys}}
stringData: {{live: {live}, bulk: {bulk}}}
"""
CHAT = {"model": MODEL, "max_tokens": 16, "temperature": 0}


async def _live(base: str, seconds: float, clients: int, think_s: float) -> list[float]:
    """TTFT (s) of every streamed chat `clients` loops finish in `seconds`, each loop pausing
    `think_s` between its requests (as people do: the pool has idle time to fill)."""
    ttfts: list[float] = []
    until = time.monotonic() + seconds
    headers = {"authorization": f"Bearer {KEYS['live']}"}

    async def loop(http: httpx.AsyncClient, n: int) -> None:
        i = 0
        while time.monotonic() < until:
            i += 1
            body = CHAT | {"stream": True, "messages": [{"role": "user", "content": f"Hi {n}.{i}"}]}
            start = time.monotonic()
            first = None
            async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.monotonic() - start
            if r.status_code == 200 and first is not None:
                ttfts.append(first)
            await asyncio.sleep(think_s)

    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        await asyncio.gather(*(loop(http, n) for n in range(clients)))
    return ttfts


def _engine_seconds(tree: ProcessTree) -> tuple[float, float]:
    """(busy, alive) seconds summed over the engines: the chargeback counters, whose ratio
    over a window is the share of the pool's time spent computing."""
    busy = alive = 0.0
    for url in tree.engine_urls().values():
        counters = scrape(url)
        busy += sum(counters["busy"].values())
        alive += counters["replica"]
    return busy, alive


def _utilisation(before: tuple[float, float], after: tuple[float, float]) -> float:
    return (after[0] - before[0]) / max(after[1] - before[1], 1e-9)


def _figures(ttfts: list[float]) -> dict[str, float]:
    ordered = sorted(ttfts)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"requests": len(ordered), "p50_s": statistics.median(ordered), "p99_s": p99}


def _submit(base: str, lines: int) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEYS["bulk"], max_retries=2)
    rows = [
        {
            "custom_id": f"l{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": CHAT | {"messages": [{"role": "user", "content": f"Line {i}: say hi."}]},
        }
        for i in range(lines)
    ]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    file = client.files.create(file=("bulk.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return client, batch.id


def _plot(result: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label in ("quiet", "with_batch"):
        ttfts = sorted(result["ttft_s"][label])
        ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=label)
    ax.set_xlabel("interactive TTFT (s)")
    ax.set_ylabel("share of requests")
    ratio = result["p99_ratio"]
    ax.set_title(f"TTFT p99 with/without a {result['lines']}-line batch: {ratio:.2f}x")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lines", type=int, default=1000)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--window", type=float, default=60.0, help="seconds of each TTFT window")
    p.add_argument("--think", type=float, default=0.5, help="seconds between a client's requests")
    p.add_argument("--batch-timeout", type=float, default=3600.0)
    p.add_argument("--work", type=Path, default=Path("bench/results/batch_interference/work"))
    p.add_argument("--out", type=Path, default=Path("bench/results/batch_interference.json"))
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    manifest = args.work / "bench.yaml"
    manifest.write_text(
        MANIFEST.format(model=MODEL, reserve=args.clients, live=KEYS["live"], bulk=KEYS["bulk"])
    )
    up = UpProcess(manifest, args.work / "logs", None, batch_dir=args.work / "batches")
    base = up.base
    try:
        up.wait_ready(300)
        asyncio.run(_live(base, 5, 1, 0.0))  # warm-up, not counted
        tree = ProcessTree(up.proc.pid)
        marks = [_engine_seconds(tree)]
        quiet = asyncio.run(_live(base, args.window, args.clients, args.think))
        marks.append(_engine_seconds(tree))
        started = time.monotonic()
        client, batch_id = _submit(base, args.lines)
        busy = asyncio.run(_live(base, args.window, args.clients, args.think))
        marks.append(_engine_seconds(tree))
        deadline = started + args.batch_timeout
        done = client.batches.retrieve(batch_id)
        while done.status not in ("completed", "failed", "expired") and time.monotonic() < deadline:
            time.sleep(1)
            done = client.batches.retrieve(batch_id)
        batch_s = time.monotonic() - started
    finally:
        up.stop()
    figures = {"quiet": _figures(quiet), "with_batch": _figures(busy)}
    ratio = figures["with_batch"]["p99_s"] / figures["quiet"]["p99_s"]
    completed = done.request_counts.completed if done.request_counts else 0
    failed = done.request_counts.failed if done.request_counts else 0
    fields = {
        "lines": args.lines,
        "clients": args.clients,
        "window_s": args.window,
        "think_s": args.think,
        "ttft": figures,
        "p99_ratio": ratio,
        "goal_p99_ratio": 1.10,
        "batch": {
            "status": done.status,
            "seconds": batch_s,
            "completed": completed,
            "failed": failed,
            "lines_per_s": completed / batch_s,
        },
        "interactive_reserved_slots": args.clients,
        "pool_utilisation": {  # engine busy seconds / alive seconds in each window
            "quiet": _utilisation(marks[0], marks[1]),
            "with_batch": _utilisation(marks[1], marks[2]),
        },
        "interactive_requests_per_s": {
            k: figures[k]["requests"] / args.window for k in ("quiet", "with_batch")
        },
        "ttft_s": {"quiet": quiet, "with_batch": busy},
    }
    save_result(args.out, "batch_interference", fields, _plot)
    print(json.dumps({k: v for k, v in fields.items() if k != "ttft_s"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
