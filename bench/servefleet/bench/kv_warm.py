"""Scale-up warm start: the first requests on a new replica, for prefixes its peer serves
hot, with and without warming its cache from the peer before it reports ready; and the
time to ready the warm adds.

Real engine processes on loopback, one key. Peer H serves `--hot` distinct ~2k-token
prompts (the pool's hot prefixes). Then a new replica starts, once per arm:
- warm: `--kv-warm-start-seconds 60`; once loaded its `/ready` says kv-warming, and it is
  sent `POST /internal/kv/warm {sources: [H]}` as the gateway's prober sends it; the warm's
  duration is the time to ready it adds;
- cold: `--kv-warm-start-seconds 0`, ready once loaded.
Then each hot prompt is asked once on the new replica: time to first token, and the cached
tokens it reports. Arms alternate (`--rounds`) in the same run. Writes JSON (CPU flags
included) and a PNG.

    uv run python -m servefleet.bench.kv_warm            # ~3 minutes here
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from servefleet.api.kv_warm import WARM_PATH, WARMING_DETAIL
from servefleet.bench.bench_output import engine_bench_parser, save_result
from servefleet.bench.engine_process import EngineProcess, thread_env
from servefleet.bench.kv_transfer import AUTH, KEY, first_token, prompt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = engine_bench_parser(__doc__, "bench/results/kv_warm.json")
    p.add_argument("--sentences", type=int, default=110, help="~17 tokens each: ~2k tokens")
    p.add_argument("--hot", type=int, default=3, help="hot prompts the peer serves")
    p.add_argument("--rounds", type=int, default=1, help="new replicas per arm")
    p.add_argument("--kv-cache-dtype", default="float32")
    return p.parse_args(argv)


def new_replica(args: argparse.Namespace, flags: list[str], warm: bool, peer: str, hot: list[str],
                log: Path) -> dict[str, Any]:  # fmt: skip
    """Start a replica (warmed from `peer` or not), then ask it each hot prompt once."""
    gate = ["--kv-warm-start-seconds", "60" if warm else "0"]
    engine = EngineProcess(args.model, log, [*flags, *gate], env=thread_env(args.threads),
                           ready_path="/health")  # fmt: skip
    with engine as e:
        warm_s, blocks = 0.0, 0
        if warm:
            r = httpx.get(e.base_url + "/ready")
            assert r.status_code == 503 and r.json()["detail"] == WARMING_DETAIL, r.text
            started = time.perf_counter()
            body = {"sources": [peer], "max_blocks": 4096, "deadline_s": 60}
            r = httpx.post(e.base_url + WARM_PATH, json=body, headers=AUTH, timeout=120)
            r.raise_for_status()
            warm_s, blocks = time.perf_counter() - started, r.json()["blocks"]
        assert httpx.get(e.base_url + "/ready").status_code == 200
        firsts = [first_token(e.base_url, text) for text in hot]
    return {"warm": warm, "added_time_to_ready_s": warm_s, "warmed_blocks": blocks,
            "requests": firsts}  # fmt: skip


def measure(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--api-key", KEY, "--kv-cache-dtype", args.kv_cache_dtype]
    flags += ["--kv-cache-memory", "768MiB", "--threads", str(args.threads)]
    flags += ["--served-model-name", "m"]
    hot = [prompt(f"hot-{i}", args.sentences) for i in range(args.hot)]
    log = args.out.with_name(f"{args.out.stem}.peer.log")
    replicas = []
    with EngineProcess(args.model, log, flags, env=thread_env(args.threads)) as peer:
        for text in hot:
            first_token(peer.base_url, text)  # the peer serves the hot prefixes
        for i in range(args.rounds):  # arms alternate: the same load for both
            for warm in (False, True):
                name = f"{args.out.stem}.{'warm' if warm else 'cold'}{i}.log"
                replicas.append(
                    new_replica(args, flags, warm, peer.base_url, hot, args.out.with_name(name))
                )
    return summarise(args, replicas)


def summarise(args: argparse.Namespace, replicas: list[dict[str, Any]]) -> dict[str, Any]:
    def arm(warm: bool) -> dict[str, Any]:
        runs = [r for r in replicas if r["warm"] is warm]
        ttfts = [q["ttft_s"] for r in runs for q in r["requests"]]
        return {
            "first_request_ttft_p50_s": statistics.median(r["requests"][0]["ttft_s"] for r in runs),
            "hot_requests_ttft_p50_s": statistics.median(ttfts),
            "cached_tokens_p50": statistics.median(
                q["cached_tokens"] for r in runs for q in r["requests"]
            ),
            "added_time_to_ready_p50_s": statistics.median(
                r["added_time_to_ready_s"] for r in runs
            ),
        }

    warm, cold = arm(True), arm(False)
    return {
        "kv_cache_dtype": args.kv_cache_dtype,
        "hot_prompts": args.hot,
        "prompt_tokens": replicas[0]["requests"][0]["prompt_tokens"],
        "warm": warm,
        "cold": cold,
        "first_request_speedup": cold["first_request_ttft_p50_s"]
        / warm["first_request_ttft_p50_s"],
        "replicas": replicas,
    }


def plot(run: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = ["first request", f"all {run['hot_prompts']} hot prompts"]
    keys = ["first_request_ttft_p50_s", "hot_requests_ttft_p50_s"]
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], [run["cold"][k] * 1000 for k in keys], 0.4,
           label="cold new replica", color="#c73")  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [run["warm"][k] * 1000 for k in keys], 0.4,
           label="warmed from a peer", color="#3a7")  # fmt: skip
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("time to first token, p50 (ms)")
    added = run["warm"]["added_time_to_ready_p50_s"]
    ax.set_title(f"new replica after scale-up (~{run['prompt_tokens']}-token prompts); "
                 f"warm adds {added:.1f} s to ready", fontsize=9)  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run = measure(args)
    fields = {"model": args.model, "threads_per_engine": args.threads, "run": run}
    save_result(args.out, "kv_warm", fields, lambda result, png: plot(result["run"], png))
    print(json.dumps({k: v for k, v in run.items() if k != "replicas"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
