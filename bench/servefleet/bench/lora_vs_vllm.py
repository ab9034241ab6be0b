"""LoRA serving against vLLM's CPU build, same run: the base model and a mix of eight adapters
at c=16, the same adapters, prompts and request shape on both servers (goal: ahead of it).

Both load the adapters through vLLM's `/v1/load_lora_adapter` (vLLM with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`), then run `lora_throughput`'s mixes: completions of
random-word prompts, `--output-tokens` each with ignore_eos, request i under adapter i mod 8;
fresh prompts for every mix of every round, the best round kept (see `lora_throughput`).
vLLM runs as `peers` runs it (OpenMP bound to every core, a fixed KV space), with
`--enable-lora --max-loras 8 --max-lora-rank R`, in float32 and, where the CPU multiplies
it natively, bfloat16: the faster of the two per mix is its best configuration here. Ours
runs with the same limits and its defaults. vLLM needs the model as a Hugging Face folder
(`bench/install_peers.sh` converts the built-in GGUF and puts `vllm` on PATH). Writes JSON
and a PNG, with the CPU's flags.

    PATH=~/.cache/servefleet/peers/bin:$PATH uv run python -m servefleet.bench.lora_vs_vllm \\
        --vllm-model ~/.cache/servefleet/peers/smollm2-hf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import httpx

from servefleet.bench.bench_output import save_result
from servefleet.bench.engine_process import EngineProcess, EngineStartError
from servefleet.bench.lora_throughput import load_all, make_adapters, prompts, run_mix

ADAPTERS = 8
MODEL = "smollm2-135m-instruct"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-model", required=True, help="the model as a Hugging Face folder")
    p.add_argument("--vllm-dtypes", default="float32,bfloat16",
                   help="each run, the best kept (bfloat16 only where the CPU has it)")  # fmt: skip
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=32, help="per mix")
    p.add_argument("--input-words", type=int, default=100)
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2, help="each mix this many times; best kept")
    p.add_argument("--adapters", type=Path, default=Path("bench/results/lora_adapters"))
    p.add_argument("--out", type=Path, default=Path("bench/results/lora_vs_vllm.json"))
    return p.parse_args(argv)


def vllm_server(args: argparse.Namespace, dtype: str, log: Path) -> EngineProcess:
    """vLLM's CPU build as `peers` runs it, with LoRA on and runtime loading allowed."""
    vllm = shutil.which("vllm")
    if vllm is None:
        raise SystemExit("no vllm command on PATH: run bench/install_peers.sh first")
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
           "VLLM_CPU_KVCACHE_SPACE": "1"}  # fmt: skip
    flags = ["--served-model-name", MODEL, "--dtype", dtype,
             "--max-num-seqs", str(args.concurrency), "--max-model-len", "2048",
             "--enable-lora", "--max-loras", str(ADAPTERS),
             "--max-lora-rank", str(args.rank)]  # fmt: skip
    return EngineProcess(args.vllm_model, log, flags, env=env, command=[vllm, "serve"],
                         ready_path="/health")  # fmt: skip


def vllm_dtypes(asked: str) -> list[str]:
    """The dtypes asked for that this CPU runs natively (bfloat16 emulated is no contender)."""
    from servefleet.engine.cpu_isa import cpu_flags, native_bf16

    return [d for d in asked.split(",") if d != "bfloat16" or native_bf16(cpu_flags())]


def our_server(args: argparse.Namespace, log: Path) -> EngineProcess:
    flags = ["--enable-lora", "--max-loras", str(ADAPTERS), "--max-lora-rank", str(args.rank),
             "--max-num-seqs", str(args.concurrency)]  # fmt: skip
    return EngineProcess(MODEL, log, flags)


def measure(args: argparse.Namespace, server: EngineProcess, paths: list[Path]) -> dict[str, Any]:
    """Adapters loaded, a warm-up, then the base and the 8-adapter mix `--rounds` times."""
    with server as engine:
        url = engine.base_url
        load_seconds = load_all(url, paths)
        warm = prompts(args.concurrency, args.input_words, seed=1)
        asyncio.run(run_mix(url, [MODEL], warm, args.concurrency, 4))
        adapter_names = [f"lora-{i}" for i in range(ADAPTERS)]
        asyncio.run(run_mix(url, adapter_names, warm, args.concurrency, 4))
        found: dict[str, list[dict[str, Any]]] = {"base": [], "adapters": []}
        for round_ in range(args.rounds):
            for mix, models in (("base", [MODEL]), ("adapters", adapter_names)):
                fresh = prompts(args.requests, args.input_words, seed=100 * round_ + len(models))
                found[mix].append(asyncio.run(
                    run_mix(url, models, fresh, args.concurrency, args.output_tokens, engine.pid)
                ))  # fmt: skip
    best = {mix: max(runs, key=lambda r: r["output_tps"]) for mix, runs in found.items()}
    return {"load_seconds": load_seconds, "rounds": found, "best": best}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    servers, width = ("servefleet", "vllm"), 0.38
    for i, server in enumerate(servers):
        values = [result[server]["best"][mix]["output_tps"] for mix in ("base", "adapters")]
        ax.bar([x + i * width for x in (0, 1)], values, width, label=server)
    ax.set_xticks([width / 2, 1 + width / 2], ["base model", f"{ADAPTERS} adapters"])
    ax.set_ylabel(f"output tokens/s (c={result['concurrency']})")
    ax.set_title(f"LoRA rank {result['rank']}: servefleet vs vLLM CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    paths = make_adapters(args.adapters, ADAPTERS, args.rank)
    logs = {name: args.out.with_name(f"{args.out.stem}.{name}.log") for name in ("ours", "vllm")}
    ours = measure(args, our_server(args, logs["ours"]), paths)
    runs, broken = {}, {}
    for dtype in vllm_dtypes(args.vllm_dtypes):
        log = logs["vllm"].with_suffix(f".{dtype}.log")
        try:
            runs[dtype] = measure(args, vllm_server(args, dtype, log), paths)
        except (EngineStartError, httpx.HTTPError) as exc:  # e.g. its bfloat16 worker's SIGILL
            broken[dtype] = f"{type(exc).__name__}: {str(exc)[-300:]} (see {log})"
            print(f"lora_vs_vllm: vLLM --dtype {dtype} failed: {broken[dtype]}", file=sys.stderr)
    if not runs:
        raise SystemExit(f"lora_vs_vllm: vLLM ran in no dtype: {broken}")
    best = {mix: max((r["best"][mix] | {"dtype": d} for d, r in runs.items()),
                     key=lambda r: r["output_tps"])
            for mix in ("base", "adapters")}  # fmt: skip
    theirs = {"best": best, "by_dtype": runs, "failed_dtypes": broken}
    ratio = {mix: ours["best"][mix]["output_tps"] / best[mix]["output_tps"]
             for mix in ("base", "adapters")}  # fmt: skip
    result = {"rank": args.rank, "concurrency": args.concurrency,
              "requests_per_mix": args.requests, "output_tokens": args.output_tokens,
              "rounds": args.rounds, "ours_over_vllm": ratio,
              "servefleet": ours, "vllm": theirs}  # fmt: skip
    result = save_result(args.out, "lora_vs_vllm", result, plot)
    print(json.dumps({"ours_over_vllm": ratio,
                      "tps": {s: {m: r["output_tps"] for m, r in result[s]["best"].items()}
                              for s in ("servefleet", "vllm")}}, indent=2))  # fmt: skip
    measured = [ours, *runs.values()]
    failed = sum(r["failed"] for s in measured for mix in s["rounds"].values() for r in mix)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
