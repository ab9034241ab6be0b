"""Step-cost constants for `sim_pd`, fitted from a short run of our engine.

The simulator prices a step as `a + b × tokens in the step`. Both constants come from the
engine's own `servefleet_engine_step_seconds` and `servefleet_engine_step_tokens` histograms:
each phase below (decodes at a few batch sizes, then long prompts that fill the token budget)
gives one (mean tokens per step, mean seconds per step) point from the histograms' sums and
counts, and a least-squares line through the points gives `a` and `b`. The KV bytes per token
come from the engine's `/internal/kv/info`.

    uv run python -m servefleet.bench.sim_pd_fit --out bench/results/sim_pd_fit.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .engine_process import EngineProcess, thread_env

KEY = "sim-pd-fit-key"
AUTH = {"authorization": f"Bearer {KEY}"}
SENTENCE = "The harbour master logged ship {i} arriving with {j} crates of tea and spices. "
DECODE_BATCHES = (1, 8, 32)
"""Concurrent decoding streams of each decode phase."""


class StepCost(BaseModel):
    """`step_s = a_s + b_s × tokens`, and what a token's KV weighs; where the numbers came from."""

    model_config = ConfigDict(frozen=True)

    a_s: float = Field(gt=0, description="fixed cost of a step (s)")
    b_s: float = Field(gt=0, description="cost of each token in the step (s)")
    kv_bytes_per_token: int = Field(gt=0)
    source: str = ""
    points: tuple[tuple[float, float], ...] = Field(
        default=(), description="(mean tokens per step, mean seconds per step) of each phase"
    )

    def step_s(self, tokens: int) -> float:
        return self.a_s + self.b_s * tokens


SMOLLM2_CPU = StepCost(
    a_s=0.0303,
    b_s=0.00339,
    kv_bytes_per_token=46080,
    source=(
        "python -m servefleet.bench.sim_pd_fit, 2026-11-27, smollm2-135m-instruct, float32 KV, "
        "one engine with --threads 1 on a shared 2-core x86 machine (noisy); KV bytes per "
        "token from /internal/kv/info (2 x 30 layers x 3 KV heads x 64 dims x 4 bytes)"
    ),
    points=((1.12, 0.02439), (8.15, 0.04861), (35.0, 0.16917), (504.29, 1.7387)),
)
"""The recorded fit `sim_pd` uses unless given another (`--fit FILE`)."""


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope of seconds over tokens."""
    x = np.array([p[0] for p in points])
    y = np.array([p[1] for p in points])
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def _histogram_totals(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for name in ("step_seconds", "step_tokens"):
        for part in ("sum", "count"):
            m = re.search(rf"^servefleet_engine_{name}_{part}(?:{{[^}}]*}})? (\S+)$", text, re.M)
            out[f"{name}_{part}"] = float(m.group(1)) if m else 0.0
    return out


def _complete(base: str, text: str, max_tokens: int) -> None:
    body = {"model": "m", "prompt": text, "max_tokens": max_tokens, "temperature": 0}
    body["ignore_eos"] = True
    r = httpx.post(base + "/v1/completions", json=body, headers=AUTH, timeout=900)
    r.raise_for_status()


def _phase(base: str, texts: list[str], max_tokens: int) -> tuple[float, float]:
    """Run `texts` at once; the (mean tokens, mean seconds) of the steps they took."""
    before = _histogram_totals(base)
    with ThreadPoolExecutor(max_workers=len(texts)) as pool:
        list(pool.map(lambda t: _complete(base, t, max_tokens), texts))
    after = _histogram_totals(base)
    steps = after["step_seconds_count"] - before["step_seconds_count"]
    seconds = (after["step_seconds_sum"] - before["step_seconds_sum"]) / steps
    tokens = (after["step_tokens_sum"] - before["step_tokens_sum"]) / steps
    return tokens, seconds


def measure(model: str, threads: int, log: Path, sentences: int) -> StepCost:
    flags = ["--api-key", KEY, "--threads", str(threads), "--served-model-name", "m"]
    with EngineProcess(model, log, flags, env=thread_env(threads)) as engine:
        base = engine.base_url
        _complete(base, "warm-up", 4)
        points = [
            _phase(base, [f"Stream {i}: count slowly." for i in range(n)], 48)
            for n in DECODE_BATCHES
        ]
        body = "".join(SENTENCE.format(i=i, j=i * 7 % 31) for i in range(sentences))
        points.append(_phase(base, [f"Log {k}. {body}" for k in range(2)], 1))
        info: dict[str, Any] = httpx.get(base + "/internal/kv/info", headers=AUTH).json()
    a, b = fit_line(points)
    per_token = int(info["bytes_per_block"]) // int(info["fields"]["block_size"])
    return StepCost(
        a_s=max(a, 1e-4),
        b_s=b,
        kv_bytes_per_token=per_token,
        source=f"measured {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} on {model}, "
        f"--threads {threads}",
        points=tuple((round(t, 2), round(s, 5)) for t, s in points),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sentences", type=int, default=90, help="~17 tokens each, per long prompt")
    p.add_argument("--out", type=Path, default=Path("bench/results/sim_pd_fit.json"))
    args = p.parse_args(argv)
    from servefleet.engine.cpu_isa import cpu_flags, ensure_safe_cpu_isa

    ensure_safe_cpu_isa()
    cost = measure(args.model, args.threads, args.out.with_suffix(".engine.log"), args.sentences)
    report = {"step_cost": cost.model_dump(), "cpu_flags": sorted(cpu_flags())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["step_cost"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
