"""Our engine against its peers (llama.cpp's server, vLLM's CPU build), same client, same prompts.

Each installed peer is started in its best CPU configuration (`peer_commands`), serving
the same GGUF file, and measured on three workloads: random prompts at concurrency 1 and
at concurrency 16 (output tok/s, ITL, TTFT) and a shared prefix at concurrency 1 (TTFT
once the prefix could be cached). Its process tree's RSS is sampled from ready to the last
request. A peer that is not installed is skipped, and the JSON and PNG say so.

    uv run python -m servefleet.bench.peers                     # ~6 minutes per peer
    uv run python -m servefleet.bench.peers --peers servefleet --c16-prompts 16   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from servefleet.api.kv_cache import KV_CACHE_DTYPES
from servefleet.api.matmul_dtype import MATMUL_DTYPES
from servefleet.bench.benchmark import BenchOptions, run_benchmark
from servefleet.bench.engine_process import EngineProcess, EngineStartError
from servefleet.bench.peer_commands import (
    PEER_NAMES,
    Installed,
    PeerCommand,
    PeerSettings,
    PeerSkipped,
    resolve_peers,
)
from servefleet.bench.rss import RssSampler
from servefleet.bench.workloads import WorkloadKind
from servefleet.engine.cpu_isa import cpu_flags, native_bf16
from servefleet.text.builtin import resolve_builtin

MB = 1e6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="built-in name or GGUF path")
    p.add_argument("--peers", default=",".join(PEER_NAMES), help="comma-separated, in order")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every peer")
    p.add_argument("--parallel", type=int, default=16, help="sequences per batch, = c16 load")
    p.add_argument("--vllm-model", default=None, help="what vLLM serves (default: the GGUF)")
    p.add_argument(
        "--vllm-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="vLLM's --dtype (auto: bfloat16 where the CPU has AVX512_BF16 or AMX, else float32)",
    )
    p.add_argument(
        "--matmul-dtype",
        default="auto",
        choices=["auto", *MATMUL_DTYPES],
        help="ours (auto: as for vLLM)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="int8",
        choices=KV_CACHE_DTYPES,
        help="ours (int8: +0.19 %% perplexity, ~15 %% faster decode steps at c=16)",
    )
    p.add_argument("--c1-prompts", type=int, default=8)
    p.add_argument("--c16-prompts", type=int, default=32)
    p.add_argument("--input-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--prefix-prompts", type=int, default=8)
    p.add_argument("--shared-prefix-tokens", type=int, default=1000)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=Path("bench/results/peers.json"))
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> PeerSettings:
    model = Path(args.model)
    gguf = model if model.is_file() else resolve_builtin(args.model)
    return PeerSettings(
        gguf=str(gguf),
        threads=args.threads,
        parallel=args.parallel,
        vllm_model=args.vllm_model,
        vllm_dtype=fastest_dtype(args.vllm_dtype),
        matmul_dtype=fastest_dtype(args.matmul_dtype),
        kv_cache_dtype=args.kv_cache_dtype,
    )


def fastest_dtype(asked: str, flags: set[str] | None = None) -> str:
    """ "auto": bfloat16 where the CPU multiplies it natively, else float32 (each engine's
    faster setting on the CPUs measured: bench/README.md)."""
    if asked != "auto":
        return asked
    return "bfloat16" if native_bf16(cpu_flags() if flags is None else flags) else "float32"


def workloads(
    args: argparse.Namespace, settings: PeerSettings, peer: PeerCommand, url: str
) -> dict[str, BenchOptions]:
    """The same three workloads for every peer; only the endpoint may differ (see the note)."""
    common: dict[str, Any] = {
        "url": url,
        "model": settings.served_model,
        "endpoint": peer.endpoint,
        "request_timeout_s": 900.0,
        "tokenizer_model": settings.gguf,  # chat prompts' lengths, by the model's tokenizer
    }
    sized = {"input_tokens": args.input_tokens, "output_tokens": args.output_tokens}
    return {
        "random_c1": BenchOptions(
            **common, **sized, concurrency=1, num_prompts=args.c1_prompts, warmup=1
        ),
        "random_c16": BenchOptions(
            **common,
            **sized,
            concurrency=args.parallel,
            num_prompts=args.c16_prompts,
            warmup=4,
        ),
        "shared_prefix_c1": BenchOptions(
            **common,
            workload=WorkloadKind.SHARED_PREFIX,
            shared_prefix_tokens=args.shared_prefix_tokens,
            input_tokens=32,
            output_tokens=16,
            concurrency=1,
            num_prompts=args.prefix_prompts,
            warmup=1,
        ),
    }


class PeerServer(EngineProcess):
    """A peer's command line on a free port, ready once its probe answers 200."""

    def __init__(self, peer: PeerCommand, log_path: Path, ready_timeout_s: float) -> None:
        env = {**os.environ, **peer.env} if peer.env else None
        super().__init__("", log_path, ready_timeout_s=ready_timeout_s, env=env)
        self.ready_path = peer.ready_path
        self.argv = peer.argv_for(self.port)


def headline(
    runs: dict[str, dict[str, Any]], peak_rss_bytes: int, peak_pss_bytes: int
) -> dict[str, Any]:
    """The figures compared across peers (p50 latencies in ms)."""
    c1, c16, prefix = runs["random_c1"], runs["random_c16"], runs["shared_prefix_c1"]
    return {
        "output_tps_c1": c1["output_token_throughput_tps"],
        "output_tps_c16": c16["output_token_throughput_tps"],
        "itl_p50_ms_c1": c1["itl_ms"]["p50"],
        "itl_p50_ms_c16": c16["itl_ms"]["p50"],
        "ttft_p50_ms_c1": c1["ttft_ms"]["p50"],
        "ttft_p50_ms_c16": c16["ttft_ms"]["p50"],
        "shared_prefix_ttft_p50_ms": prefix["ttft_ms"]["p50"],
        "peak_rss_mb": peak_rss_bytes / MB,
        "peak_pss_mb": peak_pss_bytes / MB,
        "failed": sum(run["failed"] for run in runs.values()),
    }


def run_peer(args: argparse.Namespace, settings: PeerSettings, peer: PeerCommand) -> dict[str, Any]:
    log = args.out.with_name(f"{args.out.stem}.{peer.name}.log")
    base: dict[str, Any] = {"name": peer.name, "endpoint": peer.endpoint.value, "note": peer.note}
    try:
        with PeerServer(peer, log, args.ready_timeout) as server:
            assert server.pid is not None
            base["command"] = server.argv
            with RssSampler(server.pid) as rss:
                ready_rss = rss.sample()
                runs = {}
                for name, options in workloads(args, settings, peer, server.base_url).items():
                    print(f"peers: {peer.name} {name}", file=sys.stderr, flush=True)
                    summary = asyncio.run(run_benchmark(options)).summary
                    runs[name] = summary.model_dump(mode="json")
    except EngineStartError as exc:
        return {**base, "status": "failed", "reason": str(exc).splitlines()[0]}
    return {
        **base,
        "status": "measured",
        **headline(runs, rss.peak_bytes, rss.peak_pss_bytes),
        "ready_rss_mb": ready_rss / MB,
        "runs": runs,
    }


def skipped(peer: PeerSkipped) -> dict[str, Any]:
    return {"name": peer.name, "status": "skipped", "reason": peer.reason}


def main(argv: list[str] | None = None, found: Installed | None = None) -> int:
    """`found` replaces the lookup of installed peers (tests)."""
    from servefleet.bench.peers_plot import plot  # matplotlib only here

    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = settings_from(args)
    peers = resolve_peers(settings, tuple(n for n in args.peers.split(",") if n), found)
    results = [
        run_peer(args, settings, peer) if isinstance(peer, PeerCommand) else skipped(peer)
        for peer in peers
    ]
    result = {
        "benchmark": "peers",
        "model": args.model,
        "gguf": settings.gguf,
        "threads": args.threads,
        "parallel": args.parallel,
        "peers": results,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps([{k: v for k, v in r.items() if k != "runs"} for r in results], indent=2))
    bad = [r for r in results if r["status"] == "failed" or r.get("failed")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
