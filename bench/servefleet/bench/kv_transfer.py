"""KV transfer: time to first token of a ~2k-token prompt on an engine that does not hold
it, pulling the prompt's KV blocks from an engine that does against recomputing them.

Two real engine processes on loopback, one key. Engine A computes each prompt first (so it
holds the blocks); engine B is then asked the same prompt with `kv_transfer_params`
naming A (pull arm), or a fresh prompt of the same length without it (recompute arm). Each
prompt starts differently, so B never holds a prompt before it is asked. Both arms for a
float32 and an int8 KV cache. Writes JSON (CPU flags included) and a PNG.

    uv run python -m servefleet.bench.kv_transfer            # ~3 minutes here
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

from servefleet.bench.bench_output import engine_bench_parser, save_result
from servefleet.bench.engine_process import EngineProcess, thread_env

KEY = "bench-key"
AUTH = {"authorization": f"Bearer {KEY}"}
SENTENCE = "The harbour master logged ship {i} arriving with {j} crates of tea and spices. "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = engine_bench_parser(__doc__, "bench/results/kv_transfer.json")
    p.add_argument("--sentences", type=int, default=120, help="~17 tokens each: ~2k tokens")
    p.add_argument("--repeats", type=int, default=3, help="prompts per arm and cache dtype")
    p.add_argument("--dtypes", default="float32,int8")
    return p.parse_args(argv)


def prompt(tag: str, sentences: int) -> str:
    body = "".join(SENTENCE.format(i=i, j=i * 7 % 31) for i in range(sentences))
    return f"Log {tag}. {body}Summarise the log."


def first_token(base: str, text: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """TTFT of a streamed completion, with the prompt and cached token counts it reports."""
    body: dict[str, Any] = {"model": "m", "prompt": text, "max_tokens": 2, "temperature": 0}
    body |= {"stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    started, ttft = time.perf_counter(), None
    usage: dict[str, Any] = {}
    with httpx.stream(
        "POST", base + "/v1/completions", json=body, headers=AUTH, timeout=600
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if ttft is None and event["choices"]:
                ttft = time.perf_counter() - started
            usage = event.get("usage") or usage
    assert ttft is not None, "no token came back"
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": ttft, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": details.get("cached_tokens", 0)}  # fmt: skip


def measure(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    flags = ["--api-key", KEY, "--kv-cache-dtype", dtype, "--kv-cache-memory", "768MiB"]
    flags += ["--threads", str(args.threads), "--served-model-name", "m"]
    env = thread_env(args.threads)
    logs = [args.out.with_name(f"{args.out.stem}.{dtype}.{name}.log") for name in "ab"]
    with (
        EngineProcess(args.model, logs[0], flags, env=env) as a,
        EngineProcess(args.model, logs[1], flags, env=env) as b,
    ):
        first_token(b.base_url, prompt("warm-up", 8))
        pulls, recomputes = [], []
        for i in range(args.repeats):
            held = prompt(f"{dtype}-{i}-pull", args.sentences)
            first_token(a.base_url, held)  # A computes it: now A holds its blocks
            recomputes.append(first_token(b.base_url, prompt(f"{dtype}-{i}-own", args.sentences)))
            params = {"kv_transfer_params": {"kv_sources": [a.base_url], "deadline_s": 30}}
            pulls.append(first_token(b.base_url, held, params))
        info = httpx.get(b.base_url + "/internal/kv/info", headers=AUTH).json()
    pull = statistics.median(r["ttft_s"] for r in pulls)
    recompute = statistics.median(r["ttft_s"] for r in recomputes)
    blocks = pulls[0]["cached_tokens"] // info["fields"]["block_size"]
    return {
        "kv_cache_dtype": dtype,
        "prompt_tokens": pulls[0]["prompt_tokens"],
        "pulled_tokens": pulls[0]["cached_tokens"],
        "pulled_bytes": blocks * info["bytes_per_block"],
        "recompute_ttft_p50_s": recompute,
        "pull_ttft_p50_s": pull,
        "speedup": recompute / pull,
        "pull": pulls,
        "recompute": recomputes,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(runs))
    ax.bar([x - 0.2 for x in xs], [r["recompute_ttft_p50_s"] * 1000 for r in runs], 0.4,
           label="recompute", color="#c73")  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [r["pull_ttft_p50_s"] * 1000 for r in runs], 0.4,
           label="pull from a peer", color="#3a7")  # fmt: skip
    ax.set_xticks(list(xs), [f"{r['kv_cache_dtype']} KV ({r['speedup']:.1f}x)" for r in runs])
    ax.set_ylabel("time to first token, p50 (ms)")
    ax.set_title(f"~{runs[0]['prompt_tokens']}-token prompt the replica does not hold")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = [measure(args, dtype) for dtype in args.dtypes.split(",")]
    fields = {"model": args.model, "threads_per_engine": args.threads, "runs": runs}
    save_result(args.out, "kv_transfer", fields, plot)
    for run in runs:
        print(json.dumps({k: v for k, v in run.items() if k not in ("pull", "recompute")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
