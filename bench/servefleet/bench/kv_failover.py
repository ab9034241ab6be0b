"""Failover without recompute: a stream of a ~2k-token prompt breaks at token 100; the time
from the break to the next token on another replica, with the KV pulled from a live peer
against recomputed.

Two real engine processes on loopback, one key. The holder H serves each prompt's first
100 tokens (as a peer that served the same prefix holds it). The continuation goes to
engine C exactly as the gateway sends it after a replica died (`resume_token_ids`: the 100
delivered tokens), either with `kv_transfer_params` naming the live peers (pull arm: here
a dead address first, as a gateway cannot know which peer is gone yet, then H) or without
(recompute arm: C prefills the prompt and the 100 tokens). Each arm has its own prompts, so
C never holds one before it is asked. Both arms in the same run. The gateway's own part
(noticing the break, choosing C) is not in these figures; the continuation's time to its
first token is. Writes JSON (CPU flags included) and a PNG.

    uv run python -m servefleet.bench.kv_failover            # ~3 minutes here
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from servefleet.bench.bench_output import engine_bench_parser, save_result
from servefleet.bench.engine_process import EngineProcess, thread_env
from servefleet.bench.kv_transfer import AUTH, KEY, prompt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = engine_bench_parser(__doc__, "bench/results/kv_failover.json")
    p.add_argument("--sentences", type=int, default=110, help="~17 tokens each: ~2k tokens")
    p.add_argument("--broken-at", type=int, default=100, help="tokens delivered before the break")
    p.add_argument("--repeats", type=int, default=3, help="streams per arm")
    p.add_argument("--kv-cache-dtype", default="float32")
    return p.parse_args(argv)


def stream(base: str, text: str, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    """A greedy streamed completion: its token ids, time to its first token, usage."""
    body: dict[str, Any] = {"model": "m", "prompt": text, "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": True}
    body |= {"stream_options": {"include_usage": True}, **extra}
    started, ttft = time.perf_counter(), None
    ids: list[int] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=AUTH, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event["choices"]:
                if ttft is None and choice.get("token_ids"):
                    ttft = time.perf_counter() - started
                ids += choice.get("token_ids") or []
            usage = event.get("usage") or usage
    assert ttft is not None, "no token came back"
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft_s": ttft, "ids": ids, "prompt_tokens": usage["prompt_tokens"], "cached": cached}


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def continuation(args: argparse.Namespace, h: str, c: str, tag: str, pull: bool) -> dict[str, Any]:
    text = prompt(tag, args.sentences)
    first = stream(h, text, args.broken_at, {})  # H served the stream up to the break
    extra: dict[str, Any] = {"resume_token_ids": first["ids"]}
    if pull:
        sources = [dead_address(), h]
        extra["kv_transfer_params"] = {"kv_sources": sources, "deadline_s": 30}
    rest = stream(c, text, args.broken_at + 2, extra)
    return {"break_to_next_token_s": rest["ttft_s"], "prompt_tokens": first["prompt_tokens"],
            "cached_tokens": rest["cached"]}  # fmt: skip


def measure(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--api-key", KEY, "--kv-cache-dtype", args.kv_cache_dtype]
    flags += ["--kv-cache-memory", "768MiB", "--threads", str(args.threads)]
    flags += ["--served-model-name", "m"]
    env = thread_env(args.threads)
    logs = [args.out.with_name(f"{args.out.stem}.{name}.log") for name in "hc"]
    with (
        EngineProcess(args.model, logs[0], flags, env=env) as h,
        EngineProcess(args.model, logs[1], flags, env=env) as c,
    ):
        stream(c.base_url, prompt("warm-up", 8), 2, {})
        pulls, recomputes = [], []
        for i in range(args.repeats):  # arms interleaved: the same load for both
            recomputes.append(continuation(args, h.base_url, c.base_url, f"r{i}", pull=False))
            pulls.append(continuation(args, h.base_url, c.base_url, f"p{i}", pull=True))
    pull = statistics.median(r["break_to_next_token_s"] for r in pulls)
    recompute = statistics.median(r["break_to_next_token_s"] for r in recomputes)
    return {
        "kv_cache_dtype": args.kv_cache_dtype,
        "prompt_tokens": pulls[0]["prompt_tokens"],
        "broken_at": args.broken_at,
        "pulled_tokens": pulls[0]["cached_tokens"],
        "recompute_p50_s": recompute,
        "pull_p50_s": pull,
        "speedup": recompute / pull,
        "pull": pulls,
        "recompute": recomputes,
    }


def plot(run: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(["recompute", "pull from a peer"],
           [run["recompute_p50_s"] * 1000, run["pull_p50_s"] * 1000],
           color=["#c73", "#3a7"])  # fmt: skip
    ax.set_ylabel("break to next token, p50 (ms)")
    ax.set_title(
        f"stream broken at token {run['broken_at']} of a ~{run['prompt_tokens']}-token prompt "
        f"({run['speedup']:.1f}x)",
        fontsize=9,
    )
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
    save_result(args.out, "kv_failover", fields, lambda result, png: plot(result["run"], png))
    print(json.dumps({k: v for k, v in run.items() if k not in ("pull", "recompute")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
