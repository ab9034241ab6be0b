"""The same workloads on every matmul build this CPU can run, and on an older commit, in one run.

Each arm (`isa_arms`) is one `servefleet engine` process serving the same GGUF; all arms are
up at once and the workloads (`isa_workloads`) go round them in turn, each round starting
from a different arm, so a drift of the machine's load spreads over every arm instead of
landing on one. Every figure is then given as a ratio to this checkout's default build
(higher is better, latencies inverted), and each current arm against the older commit's
same build: a change that helps one ISA and hurts another shows as a ratio below 1.

    uv run python -m servefleet.bench.isa_matrix                      # ~3 minutes per arm
    uv run python -m servefleet.bench.isa_matrix --quick --arms current/avx2/float32
    uv run python -m servefleet.bench.isa_matrix --baseline-commit 131f427 --with-plain
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from servefleet.bench.engine_process import EngineProcess
from servefleet.bench.isa_arms import (
    ISA_FLAGS,
    Arm,
    default_arm,
    engine_args,
    plan_arms,
    select_arms,
)
from servefleet.bench.isa_ratios import add_ratios
from servefleet.bench.isa_workloads import (
    QUICK,
    WORKLOADS,
    Sizes,
    figures_of,
    measure,
    workload_options,
)
from servefleet.bench.rss import RssSampler
from servefleet.bench.source_trees import SourceTree, commit_tree, current_tree, exported_tree
from servefleet.engine.cpu_isa import cpu_flags
from servefleet.text.builtin import resolve_builtin

MB = 1e6
SERVED = "smollm2-135m-instruct"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=SERVED, help="built-in name or GGUF path")
    p.add_argument("--quick", action="store_true", help="1 request per workload, 16 tokens out")
    p.add_argument("--baseline-commit", default=None, help="older commit run beside this one")
    p.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="the older commit already exported here (no git needed); names it --baseline-commit",
    )
    p.add_argument("--with-plain", action="store_true", help="also the plain-C matmul build")
    p.add_argument("--arms", default=None, help="comma-separated arm names (default: all)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 2, quick 1)")
    p.add_argument("--c1-prompts", type=int, default=None, help="c=1 requests (default 4)")
    p.add_argument("--c16-prompts", type=int, default=None, help="c=16 requests (default 32)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every engine")
    p.add_argument("--kv-cache-dtype", default="int8", help="where the engine knows it")
    p.add_argument(
        "--conditions", default="measured under load", help="how the machine was (recorded)"
    )
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="output folder")
    args = p.parse_args(argv)
    if args.baseline_tree and not args.baseline_commit:
        p.error("--baseline-tree needs --baseline-commit, the commit it was exported from")
    return args


def cpu_record() -> dict[str, Any]:
    flags = cpu_flags()
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "model": model or platform.processor(),
        "cores": os.cpu_count(),
        "isa_flags": {f: f in flags for f in ISA_FLAGS},
        "flags": sorted(flags),
    }


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def start_arms(
    stack: contextlib.ExitStack,
    args: argparse.Namespace,
    trees: dict[str, SourceTree],
    arms: list[Arm],
    gguf: str,
    parallel: int,
) -> dict[str, tuple[EngineProcess, RssSampler, dict[str, Any]]]:
    """Every arm's engine, started together (a cold start is minutes on a loaded machine),
    all left running; each is stopped when `stack` closes, whatever happened."""
    engines, records = [], []
    for arm in arms:
        tree = trees[arm.tree]
        extra, isa_env, dropped = engine_args(
            tree, arm, SERVED, args.threads, parallel, args.kv_cache_dtype
        )
        log = args.out / f"isa_matrix.{arm.slug}.log"
        engine = EngineProcess(
            gguf, log, extra, ready_timeout_s=args.ready_timeout, env=tree.env(isa_env)
        )
        stack.callback(engine.stop)
        engines.append(engine)
        records.append(
            {
                "name": arm.name,
                **arm.model_dump(),
                "commit": tree.commit,
                "argv": engine.argv,
                "env": isa_env,
                "dropped_flags": dropped,
            }
        )
    print(f"isa_matrix: starting {len(arms)} engines", file=sys.stderr, flush=True)
    with ThreadPoolExecutor(len(engines)) as pool:
        list(pool.map(EngineProcess.__enter__, engines))  # re-raises the first failure
    started = {}
    for engine, record in zip(engines, records, strict=True):
        assert engine.pid is not None
        rss = stack.enter_context(RssSampler(engine.pid))
        ready = {"ready_rss_mb": rss.sample() / MB, "ready_pss_mb": rss.pss_samples[-1] / MB}
        started[record["name"]] = (engine, rss, {**record, **ready})
    return started


def run_rounds(
    started: dict[str, tuple[EngineProcess, RssSampler, dict[str, Any]]],
    sizes: Sizes,
    rounds: int,
) -> dict[str, dict[str, list[float | None]]]:
    """arm -> "workload.figure" -> one value per round; workloads in order, arms in turn."""
    names = list(started)
    values: dict[str, dict[str, list[float | None]]] = {n: {} for n in names}
    for round_no in range(rounds):
        order = names[round_no % len(names) :] + names[: round_no % len(names)]
        for workload in WORKLOADS:
            for name in order:
                engine = started[name][0]
                options = workload_options(engine.base_url, SERVED, sizes, seed=round_no)
                print(
                    f"isa_matrix: {time.strftime('%X')} round {round_no} {workload} {name}",
                    file=sys.stderr,
                    flush=True,
                )
                for key, value in figures_of(workload, measure(options[workload])).items():
                    values[name].setdefault(f"{workload}.{key}", []).append(value)
    return values


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None and v == v]  # drop None and NaN
    return statistics.median(known) if known else None


def arm_results(
    started: dict[str, tuple[EngineProcess, RssSampler, dict[str, Any]]],
    values: dict[str, dict[str, list[float | None]]],
) -> list[dict[str, Any]]:
    results = []
    for name, (_, rss, record) in started.items():
        figures = {key: median(v) for key, v in values[name].items()}
        figures["peak_rss_mb"] = rss.peak_bytes / MB
        figures["peak_pss_mb"] = rss.peak_pss_bytes / MB
        results.append({**record, "figures": figures, "per_round": values[name]})
    return results


def measure_matrix(
    args: argparse.Namespace, trees: dict[str, SourceTree], arms: list[Arm]
) -> list[dict[str, Any]]:
    model = Path(args.model)
    gguf = str(model if model.is_file() else resolve_builtin(args.model))
    sizes = QUICK if args.quick else Sizes()
    asked = {"c1_prompts": args.c1_prompts, "c16_prompts": args.c16_prompts}
    sizes = sizes.model_copy(update={k: v for k, v in asked.items() if v})
    rounds = args.rounds or (1 if args.quick else 2)
    with contextlib.ExitStack() as stack:
        started = start_arms(stack, args, trees, arms, gguf, sizes.concurrency)
        values = run_rounds(started, sizes, rounds)
        stack.close()  # stop the engines: the samplers' last reads come after the load
        return arm_results(started, values)


def main(argv: list[str] | None = None) -> int:
    from servefleet.bench.isa_report import markdown_table, plot  # matplotlib only here

    args = parse_args(argv)
    # a SIGTERM (e.g. `timeout`) unwinds the with-blocks: engines stopped, worktree removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        trees = {"current": current_tree()}
        if args.baseline_commit:
            baseline = (
                exported_tree(args.baseline_commit, args.baseline_tree)
                if args.baseline_tree
                else stack.enter_context(commit_tree(args.baseline_commit))
            )
            trees[baseline.label] = baseline
        flags = cpu_flags()
        arms = select_arms(plan_arms(list(trees.values()), flags, args.with_plain), args.arms)
        load_before = load_average()
        arms_out = measure_matrix(args, trees, arms)
    result = {
        "benchmark": "isa_matrix",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "conditions": args.conditions,
        "load_average": {"before": load_before, "after": load_average()},
        "quick": args.quick,
        "model": args.model,
        "threads": args.threads,
        "cpu": cpu_record(),
        "commits": {t.label: t.commit for t in trees.values()},
        "trees": [t.model_dump() for t in trees.values()],
        "default_arm": default_arm(arms).name,
        "arms": arms_out,
    }
    add_ratios(result)
    path = args.out / "isa_matrix.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, path.with_suffix(".png"))
    print(markdown_table(result))
    failed = sum(v or 0 for a in arms_out for w in WORKLOADS for v in a["per_round"][f"{w}.failed"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
