"""The P/D simulator's invariants on a tiny workload: every request finishes with all its
tokens, P/D decode steps hold no prompt tokens, a P/D stream's gaps are decode-only steps,
and every token is computed exactly once in both modes."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from servefleet.bench import sim_pd
from servefleet.bench.sim_bursty import BurstySpec
from servefleet.bench.sim_pd_fit import StepCost, fit_line
from servefleet.bench.sim_pd_model import PDResult, PDWorkload, PoolSpec, simulate_pool

COST = StepCost(a_s=0.01, b_s=0.001, kv_bytes_per_token=1000)
SEQS = 4
BUDGET = 64


def workload() -> PDWorkload:
    """Long prompts arrive while short ones decode; some answers are a single token."""
    rng = np.random.default_rng(3)
    n = 24
    prompts = rng.integers(2, 40, size=n)
    prompts[::5] = rng.integers(200, 400, size=prompts[::5].size)
    outputs = rng.integers(1, 30, size=n)
    outputs[1] = 1
    return PDWorkload(
        name="tiny",
        duration_s=2.0,
        arrivals_s=np.sort(rng.uniform(0, 2.0, size=n)),
        prompt_tokens=prompts,
        output_tokens=outputs,
    )


def run(prefill: int, decode: int) -> tuple[PDWorkload, PDResult]:
    work = workload()
    pool = PoolSpec(
        prefill=prefill,
        decode=decode,
        max_num_seqs=SEQS,
        max_batched_tokens=BUDGET,
        kv_bandwidth_bytes_s=1e6,
    )
    return work, simulate_pool(work, pool, COST, itl_slo_s=0.05, log_tokens=True)


def tokens_by_request(result: PDResult) -> dict[int, list[tuple[float, int]]]:
    out: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for req, t, step in result.token_log:
        out[req].append((t, step))
    return out


@pytest.mark.parametrize("pools", [(0, 2), (1, 1), (1, 2)])
def test_every_request_finishes_with_all_its_tokens(pools: tuple[int, int]) -> None:
    work, result = run(*pools)
    assert np.isfinite(result.finish_s).all()
    assert (result.ttft_s >= work.arrivals_s).all()
    got = tokens_by_request(result)
    assert [len(got[i]) for i in range(work.arrivals_s.size)] == work.output_tokens.tolist()
    for times in got.values():
        assert all(a[0] <= b[0] for a, b in itertools.pairwise(times))


@pytest.mark.parametrize("pools", [(0, 2), (1, 1), (2, 1)])
def test_every_token_is_computed_once(pools: tuple[int, int]) -> None:
    work, result = run(*pools)
    prompt, decode = np.array(result.step_prefill_tokens), np.array(result.step_decode_tokens)
    assert prompt.sum() == work.prompt_tokens.sum()
    assert decode.sum() == (work.output_tokens - 1).sum()
    assert (prompt + decode <= BUDGET).all()
    assert (decode <= SEQS).all()


def test_pd_decode_steps_hold_no_prompt_tokens_and_prefill_steps_no_decodes() -> None:
    _, result = run(1, 2)
    roles = np.array(result.step_role)
    prompt, decode = np.array(result.step_prefill_tokens), np.array(result.step_decode_tokens)
    assert set(roles) == {"prefill", "decode"}
    assert (prompt[roles == "decode"] == 0).all() and (decode[roles == "prefill"] == 0).all()
    assert prompt[roles == "prefill"].sum() > 0 and decode[roles == "decode"].sum() > 0


def test_pd_gaps_are_decode_only_steps() -> None:
    """After the first token (which comes with the KV) every token ends a decode-only step;
    from the third on, its gap is exactly that step; the second's step starts after the KV
    arrived (any wait before it is for a decode slot, never for a prompt)."""
    _, result = run(1, 2)
    start, end = np.array(result.step_start_s), np.array(result.step_end_s)
    roles, prompt = result.step_role, result.step_prefill_tokens
    longest_decode_step = COST.step_s(SEQS)
    checked = 0
    for tokens in tokens_by_request(result).values():
        assert tokens[0][1] == -1  # the first token arrived with the KV, from no step
        for k in range(1, len(tokens)):
            t, step = tokens[k]
            assert roles[step] == "decode" and prompt[step] == 0
            assert end[step] - start[step] <= longest_decode_step + 1e-9
            if k == 1:  # it may queue for a decode slot, then joins at a step boundary
                assert start[step] >= tokens[0][0]
            else:
                assert t - tokens[k - 1][0] == pytest.approx(end[step] - start[step])
            checked += 1
    assert checked > 50


def test_colocated_gaps_do_include_prompt_chunks() -> None:
    """The same workload colocated: some stream waits through a step carrying a prompt chunk
    (so the P/D check above is not true of any pool)."""
    _, result = run(0, 2)
    prompt = result.step_prefill_tokens
    late = [
        step
        for tokens in tokens_by_request(result).values()
        for _, step in tokens[1:]
        if prompt[step] > 0
    ]
    assert late
    assert result.max_gap_s.max() > 2 * COST.step_s(SEQS)


def test_pd_ttft_pays_the_prefill_and_the_kv_hand_over() -> None:
    work, result = run(1, 1)
    prefill = COST.a_s + COST.b_s * np.minimum(work.prompt_tokens, BUDGET)
    hand_over = COST.kv_bytes_per_token * work.prompt_tokens / 1e6
    assert (result.ttft_s - work.arrivals_s >= prefill + hand_over - 1e-9).all()


def test_fit_line_recovers_a_line() -> None:
    a, b = fit_line([(1, 0.011), (10, 0.02), (100, 0.11), (500, 0.51)])
    assert a == pytest.approx(0.01) and b == pytest.approx(0.001)


def test_workload_keeps_prompts_and_outputs_in_the_window() -> None:
    work = sim_pd.make_pd_workload(BurstySpec(duration_s=60.0), max_prompt=512, max_output=64)
    assert work.arrivals_s.size > 10
    assert work.prompt_tokens.max() <= 512 and work.prompt_tokens.min() >= 2
    assert work.output_tokens.max() <= 64 and work.output_tokens.min() >= 1
    assert (np.diff(work.arrivals_s) >= 0).all()


def test_cli_writes_frontiers(tmp_path: Path) -> None:
    argv = ["--out", str(tmp_path), "--duration", "20", "--sizes", "2,3", "--jobs", "1"]
    assert sim_pd.main([*argv, "--prefill-shares", "0.5", "--colocated-budgets", "128"]) == 0
    report = json.loads((tmp_path / "sim_pd.json").read_text())
    assert (tmp_path / "sim_pd.png").stat().st_size > 0
    assert report["source"].startswith("simulator")
    modes = [(r["mode"], r["prefill"], r["decode"]) for r in report["runs"]]
    assert modes == [("colocated", 0, 2), ("colocated", 0, 3), ("pd", 1, 1), ("pd", 2, 1)]
    requests = report["workload"]["requests"]
    assert all(r["finished"] == requests for r in report["runs"])
    for view in sim_pd.VIEWS:
        front = report["summary"][view]["frontier"]
        assert front["colocated"] and front["pd"]
        costs = [p["cost"] for p in front["pd"]]
        assert costs == sorted(costs)


def test_itl_quantiles_are_of_the_gaps_streams_saw() -> None:
    work, result = run(1, 2)
    gaps = [
        b[0] - a[0] for t in tokens_by_request(result).values() for a, b in itertools.pairwise(t)
    ]
    assert len(result.all_gaps_s) == len(gaps) == (work.output_tokens - 1).sum()
    assert result.itl_quantile(1.0) == pytest.approx(max(gaps))
    assert result.itl_quantile(1.0) == pytest.approx(result.max_gap_s.max())
