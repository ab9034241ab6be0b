"""Disaggregated prefill/decode against colocated pools, in the step-level simulator.

These figures come from the simulator (`sim_pd_model`), not from engines: replicas are modelled
at step level with the step cost fitted from our engine (`sim_pd_fit`), on a mixed workload
(the bursty trace's arrivals and heavy-tailed prompts: long prompts arrive while others
decode). It sweeps colocated pool sizes and, at the same sizes, prefill:decode splits, and
reports each mode's frontier (`sim_frontier.frontier`) of replica-hours against the share of
requests meeting the ITL-p99 target, the TTFT target, and both.

    uv run python -m servefleet.bench.sim_pd --out bench/results/sim_pd
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .sim_bursty import BurstySpec, _arrivals
from .sim_frontier import Point, frontier
from .sim_pd_fit import SMOLLM2_CPU, StepCost
from .sim_pd_model import PDResult, PDWorkload, PoolSpec, simulate_pool

VIEWS = ("itl", "ttft", "both")
MODES = ("colocated", "pd")


class SloSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    itl_p99_s: float = Field(default=0.2, gt=0, description="a stream's own ITL p99 at most")
    ttft_s: float = Field(default=2.0, gt=0, description="TTFT allowed on top of the prompt's")
    ttft_per_prompt_token_s: float = Field(
        default=0.004, ge=0, description="TTFT allowed per prompt token (a long prompt may wait)"
    )
    goal: float = Field(default=0.99, gt=0, le=1, description="attainment a pool must reach")


def make_pd_workload(
    spec: BurstySpec, max_prompt: int = 4096, max_output: int = 1024, name: str = "bursty-mixed"
) -> PDWorkload:
    """The bursty trace's requests (same draws as `make_bursty_trace`), prompt and output kept
    apart and capped to a context window."""
    rng = np.random.default_rng(spec.seed)
    arrivals = _arrivals(spec, rng)
    n = arrivals.size
    output = rng.lognormal(np.log(spec.output_median), spec.output_sigma, size=n)
    prompt = spec.prompt_min * (1 + rng.pareto(spec.prompt_alpha, size=n))
    return PDWorkload(
        name=name,
        duration_s=spec.duration_s,
        arrivals_s=arrivals,
        prompt_tokens=np.clip(np.round(prompt), 2, max_prompt).astype(np.int64),
        output_tokens=np.clip(np.round(output), 1, max_output).astype(np.int64),
    )


def pools_for(
    sizes: list[int], prefill_shares: list[float], budgets: list[int], base: PoolSpec
) -> list[PoolSpec]:
    """Colocated pools of each size at each step token budget (a smaller budget means smaller
    prompt chunks beside the decodes), and at each size every P:D split the shares give."""
    out = [
        base.model_copy(update={"prefill": 0, "decode": n, "max_batched_tokens": b})
        for n in sizes
        for b in budgets
    ]
    for n in sizes:
        splits = {max(1, min(n - 1, round(n * s))) for s in prefill_shares}
        out += [base.model_copy(update={"prefill": p, "decode": n - p}) for p in sorted(splits)]
    return out


def attainment(
    result: PDResult, arrivals_s: np.ndarray, prompt_tokens: np.ndarray, slo: SloSpec
) -> dict[str, float]:
    """Shares of requests whose own ITL p99 (at most 1 % of its gaps over the target), TTFT,
    or both met the targets."""
    itl_ok = result.slow_gaps <= np.floor(0.01 * result.gaps)
    allowed_ttft = slo.ttft_s + slo.ttft_per_prompt_token_s * prompt_tokens
    ttft_ok = result.ttft_s - arrivals_s <= allowed_ttft
    return {
        "itl": float(itl_ok.mean()),
        "ttft": float(ttft_ok.mean()),
        "both": float((itl_ok & ttft_ok).mean()),
    }


def run_pool(work: PDWorkload, pool: PoolSpec, cost: StepCost, slo: SloSpec) -> dict[str, Any]:
    """One pool over the workload: its cost, attainments and latency quantiles."""
    result = simulate_pool(work, pool, cost, slo.itl_p99_s)
    ttft = result.ttft_s - work.arrivals_s
    return {
        "mode": "pd" if pool.disaggregated else "colocated",
        "prefill": pool.prefill,
        "decode": pool.decode,
        "replicas": pool.replicas,
        "max_batched_tokens": pool.max_batched_tokens,
        "replica_hours": round(pool.replicas * work.duration_s / 3600, 3),
        "attainment": {
            k: round(v, 5)
            for k, v in attainment(result, work.arrivals_s, work.prompt_tokens, slo).items()
        },
        "itl_p50_s": round(result.itl_quantile(0.5), 4),
        "itl_p99_s": round(result.itl_quantile(0.99), 4),
        "ttft_p50_s": round(float(np.quantile(ttft, 0.5)), 3),
        "ttft_p99_s": round(float(np.quantile(ttft, 0.99)), 3),
        "finished": int(np.isfinite(result.finish_s).sum()),
        "steps": len(result.step_role),
    }


def to_point(run: dict[str, Any], view: str, trace: str) -> Point:
    settings = {k: float(run[k]) for k in ("prefill", "decode", "max_batched_tokens")}
    return Point(
        trace=f"{trace}:{view}",
        policy=run["mode"],
        settings=settings,
        slo_attainment=run["attainment"][view],
        replica_hours=run["replica_hours"],
        spilled_requests=0,
        spilled_tokens=0,
        cost=run["replica_hours"],
        p99_wait_s=run["ttft_p99_s"],
        batch_p99_wait_s=run["itl_p99_s"],
    )


def summarise(runs: list[dict[str, Any]], trace: str, goal: float) -> dict[str, Any]:
    """Each mode's frontier per view, and the fewest replicas meeting the goal."""
    out: dict[str, Any] = {}
    for view in VIEWS:
        points = [to_point(r, view, trace) for r in runs]
        fronts = {m: frontier([p for p in points if p.policy == m]) for m in MODES}
        cheapest = {
            m: min(
                (p.cost for p in points if p.policy == m and p.slo_attainment >= goal), default=None
            )
            for m in MODES
        }
        out[view] = {
            "frontier": {m: [p.model_dump() for p in f] for m, f in fronts.items()},
            "cheapest_meeting_goal_replica_hours": cheapest,
        }
    return out


def plot(runs: list[dict[str, Any]], summary: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"colocated": "tab:gray", "pd": "tab:blue"}
    fig, axes = plt.subplots(1, 4, figsize=(22, 5))
    for ax, view in zip(axes, VIEWS, strict=False):
        for mode in MODES:
            mine = [r for r in runs if r["mode"] == mode]
            xs = [r["replica_hours"] for r in mine]
            ax.scatter(xs, [100 * r["attainment"][view] for r in mine], s=14, alpha=0.5,
                       color=colours[mode])  # fmt: skip
            front = summary[view]["frontier"][mode]
            ax.step([p["cost"] for p in front], [100 * p["slo_attainment"] for p in front],
                    where="post", color=colours[mode], label=mode, lw=1.4)  # fmt: skip
        ax.axhline(99, color="black", lw=0.6, ls=":")
        ax.set_xlabel("replica-hours")
        ax.set_ylabel(f"requests meeting the {view} target (%)")
        ax.set_title(f"{view} attainment (simulated)")
        ax.legend(loc="lower right")
    ax = axes[3]
    for mode in MODES:
        mine = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["replicas"])
        ax.scatter([r["replicas"] for r in mine], [1000 * r["itl_p99_s"] for r in mine],
                   color=colours[mode], label=mode, s=14)  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("replicas")
    ax.set_ylabel("fleet ITL p99 (ms, simulated)")
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench/results/sim_pd"))
    p.add_argument("--duration", type=float, default=600.0, help="simulated seconds of trace")
    p.add_argument("--rate-scale", type=float, default=1.0, help="times the bursty trace's rates")
    p.add_argument("--sizes", default="8,12,16,20,24,32,40,48", help="replicas per pool")
    p.add_argument("--prefill-shares", default="0.375,0.5,0.625,0.75", help="P / (P + D)")
    p.add_argument("--colocated-budgets", default="512,128", help="step token budgets")
    p.add_argument("--itl-slo", type=float, default=0.3, help="seconds, a stream's ITL p99")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds on top of per-token")
    p.add_argument("--ttft-per-token", type=float, default=0.004, help="seconds per prompt token")
    p.add_argument("--kv-bandwidth", type=float, default=1.25e9, help="P to D bytes/s (10 GbE)")
    p.add_argument("--fit", type=Path, default=None, help="a sim_pd_fit JSON (default: recorded)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--seed", type=int, default=11)
    return p.parse_args(argv)


def _describe(work: PDWorkload, spec: BurstySpec) -> dict[str, Any]:
    quantiles = (0.5, 0.99)
    return {
        "name": work.name,
        "requests": int(work.arrivals_s.size),
        "duration_s": work.duration_s,
        "bursty": spec.model_dump(),
        "prompt_tokens_p50_p99": [int(np.quantile(work.prompt_tokens, q)) for q in quantiles],
        "output_tokens_p50_p99": [int(np.quantile(work.output_tokens, q)) for q in quantiles],
    }


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cost = SMOLLM2_CPU
    if args.fit is not None:
        cost = StepCost(**json.loads(args.fit.read_text())["step_cost"])
    spec = BurstySpec(duration_s=args.duration, seed=args.seed)
    scaled = {k: getattr(spec, k) * args.rate_scale for k in ("quiet_rate", "burst_rate")}
    spec = spec.model_copy(update=scaled)
    work = make_pd_workload(spec)
    slo = SloSpec(
        itl_p99_s=args.itl_slo, ttft_s=args.ttft_slo, ttft_per_prompt_token_s=args.ttft_per_token
    )
    base = PoolSpec(decode=1, kv_bandwidth_bytes_s=args.kv_bandwidth)
    sizes = [int(s) for s in _floats(args.sizes)]
    budgets = [int(b) for b in _floats(args.colocated_budgets)]
    pools = pools_for(sizes, _floats(args.prefill_shares), budgets, base)
    started = time.monotonic()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        runs = list(ex.map(run_pool, *zip(*[(work, p, cost, slo) for p in pools], strict=True)))
    summary = summarise(runs, work.name, slo.goal)
    report = {
        "benchmark": "sim_pd",
        "source": "simulator (sim_pd_model), not engines",
        "step_cost": cost.model_dump(),
        "slo": slo.model_dump(),
        "pool": base.model_dump(exclude={"prefill", "decode", "max_batched_tokens"}),
        "workload": _describe(work, spec),
        "seconds": round(time.monotonic() - started, 1),
        "runs": runs,
        "summary": summary,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_pd.json").write_text(json.dumps(report, indent=2))
    title = (
        f"P/D vs colocated, SIMULATED: {work.arrivals_s.size} requests in {work.duration_s:g} s,"
        f" step = {cost.a_s * 1e3:.1f} ms + {cost.b_s * 1e3:.2f} ms/token"
    )
    plot(runs, summary, args.out / "sim_pd.png", title)
    keys = ("replicas", "prefill", "max_batched_tokens", "attainment", "itl_p99_s", "ttft_p99_s")
    for r in sorted(runs, key=lambda r: (r["replicas"], r["prefill"])):
        print(json.dumps({k: r[k] for k in keys}))
    print(json.dumps({v: summary[v]["cheapest_meeting_goal_replica_hours"] for v in VIEWS}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
