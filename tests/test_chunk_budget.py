"""Prompt chunks beside decodes sized by the step-cost model (`--max-decode-step-ms`):
the model's fit, the allowance it gives, and the scheduler under a fake clock (each step's
seconds come from a known cost law, never from wall time)."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from servefleet.api.step_cost import (
    AUTO_TARGET_FACTOR,
    DECODE_STEP_TARGET_METRIC,
    PROMPT_CHUNK_METRIC,
    STEP_COST_METRIC,
    STEP_COST_TERMS,
    DecodeStepTarget,
    parse_decode_step_target,
)
from servefleet.engine.chunk_budget import ChunkBudget, chunk_budget_for
from servefleet.engine.config import EngineConfig
from servefleet.engine.kv_cache import KVCacheManager
from servefleet.engine.metrics import EngineMetrics
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from servefleet.engine.sequence import Sequence
from servefleet.engine.step_cost import PRIORS, StepCostModel, StepShape

BS = 16
BUDGET = 512
# The machine's true cost law (seconds): fixed, per decode row, per prompt token, per
# prompt token x 1k context, per step with prompt tokens.
TRUE = (0.004, 0.0005, 0.0002, 0.00005, 0.003)


def true_seconds(shape: StepShape) -> float:
    return float(shape.features() @ TRUE)


def trained(steps: int = 300, seed: int = 0) -> StepCostModel:
    """A model that has seen `steps` varied steps under TRUE."""
    rng = random.Random(seed)
    model = StepCostModel()
    for _ in range(steps):
        chunks = [(rng.randint(1, 400), rng.randint(0, 1500))] if rng.random() < 0.6 else []
        shape = StepShape.of(rng.randint(0, 16), chunks)
        model.observe(shape, true_seconds(shape))
    return model


def make(chunk_budget: ChunkBudget | None, max_seqs: int = 16) -> Scheduler:
    kv = KVCacheManager(1024, BS, True)
    return Scheduler(SchedulerConfig(max_seqs, BUDGET, 4096), kv, [], None, chunk_budget)


def seq(n: int, start: int, max_tokens: int, t: float) -> Sequence:
    prompt = [(start + 7 * i) % 900 + 3 for i in range(n)]
    return Sequence(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), t)


def step(s: Scheduler, model: StepCostModel | None = None) -> SchedulerOutput:
    """Schedule, 'run' under the fake clock, feed the model, apply one token per sampler."""
    out = s.schedule()
    if model is not None:
        model.observe(out.step_shape, true_seconds(out.step_shape))
    s.update(out, {c.seq.seq_id: [11] for c in out.chunks if c.samples})
    return out


def start_decodes(s: Scheduler, model: StepCostModel | None, count: int = 4) -> list[Sequence]:
    seqs = [seq(40 + i, 100 * i, 400, float(i)) for i in range(count)]
    for x in seqs:
        s.add(x)
    step(s, model)  # all prompts in one step: nothing decodes yet
    assert all(x.num_output_tokens == 1 for x in seqs)
    return seqs


def test_the_model_starts_at_its_priors_and_learns_the_cost_law() -> None:
    fresh = StepCostModel()
    assert list(fresh.coefficients.values()) == pytest.approx(PRIORS)
    assert tuple(fresh.coefficients) == STEP_COST_TERMS
    model = trained()
    # Prompt tokens, their attention and the prompt-step switch move together, so the fit
    # is judged by its predictions; the per-step and per-decode terms are identified alone.
    learnt = model.coefficients
    assert learnt["fixed"] == pytest.approx(TRUE[0], rel=0.05)
    assert learnt["decode_row"] == pytest.approx(TRUE[1], rel=0.05)
    assert learnt["prompt_token"] == pytest.approx(TRUE[2], rel=0.2)
    rng = random.Random(9)
    for _ in range(50):
        shape = StepShape.of(rng.randint(0, 16), [(rng.randint(1, 400), rng.randint(0, 1500))])
        assert model.predict(shape) == pytest.approx(true_seconds(shape), rel=0.06, abs=0.001)


def test_pure_decode_steps_leave_the_prompt_terms_at_their_priors() -> None:
    model = StepCostModel()
    for i in range(200):
        shape = StepShape(decode_rows=1 + i % 8)
        model.observe(shape, true_seconds(shape))
    c = model.coefficients
    assert c["prompt_token"] == pytest.approx(PRIORS[2])
    assert c["decode_row"] == pytest.approx(TRUE[1], rel=0.05)
    assert model.decode_step(4) == pytest.approx(TRUE[0] + 4 * TRUE[1], rel=0.05)


def test_the_allowance_fits_the_target_and_follows_the_model() -> None:
    model = trained()
    target = DecodeStepTarget(seconds=0.030)
    allowance = ChunkBudget(model, target, BS).allowance(decode_rows=4, max_tokens=508)
    assert allowance is not None
    n = allowance.take(10_000, context=0)
    predicted = model.predict(StepShape.of(4, [(n, 0)]))
    assert predicted <= 0.030 + 1e-9
    assert model.predict(StepShape.of(4, [(n + 2, 0)])) > 0.030  # the largest that fits
    # Later in a long prompt attention costs more: the same target buys fewer tokens.
    later = ChunkBudget(model, target, BS).allowance(4, 508)
    assert later is not None and later.take(10_000, context=1400) < n
    # Dearer prompt tokens: a smaller chunk.
    dear = StepCostModel((0.004, 0.0005, 0.0004, 0.00005, 0.003))
    pricey = ChunkBudget(dear, target, BS).allowance(4, 508)
    assert pricey is not None and pricey.take(10_000, context=0) < n


def test_auto_is_a_factor_of_the_predicted_decode_step() -> None:
    model = trained()
    budget = ChunkBudget(model, DecodeStepTarget(factor=AUTO_TARGET_FACTOR), BS)
    assert budget.allowance(4, 508) is not None
    assert budget.last_target_seconds == pytest.approx(AUTO_TARGET_FACTOR * model.decode_step(4))


def test_no_decode_running_or_off_means_no_limit() -> None:
    model = trained()
    assert ChunkBudget(model, DecodeStepTarget(seconds=0.01), BS).allowance(0, 512) is None
    assert chunk_budget_for(DecodeStepTarget(), model, BS) is None


def test_a_long_prompt_beside_decodes_is_chunked_to_the_target_and_no_decode_skipped() -> None:
    model = trained()
    budget = ChunkBudget(model, DecodeStepTarget(seconds=0.030), BS)
    s = make(budget)
    decoding = start_decodes(s, model)
    long = seq(1500, 7, 2, 10.0)
    s.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = step(s, model)
        assert {c.seq for c in out.decodes} == set(decoding)  # every decode, every step
        assert len(out.prefills) == 1 and out.prefills[0].seq is long
        chunks.append(out.prefills[0].num_new_tokens)
        assert true_seconds(out.step_shape) <= 0.030 + 1e-3  # the fit is near the true law
        assert budget.last_chunk_tokens == chunks[-1]
    assert sum(chunks) == 1500 and len(chunks) > 1500 // BUDGET + 1
    assert chunks[0] > chunks[-2]  # attention grows with context: later chunks are smaller


def test_a_target_below_the_decode_step_still_moves_the_prompt_a_block_a_step() -> None:
    model = trained()
    s = make(ChunkBudget(model, DecodeStepTarget(seconds=0.0001), BS))
    decoding = start_decodes(s, model)
    long = seq(200, 7, 2, 10.0)
    s.add(long)
    for _ in range(200 // BS + 1):
        out = step(s, model)
        assert {c.seq for c in out.decodes} == set(decoding)
        assert [c.num_new_tokens for c in out.prefills] == [min(BS, 200 - 16 * (_))]
    assert long.num_output_tokens == 1  # never starved


def test_with_no_decode_running_a_prompt_takes_the_full_budget() -> None:
    s = make(ChunkBudget(trained(), DecodeStepTarget(seconds=0.001), BS))
    long = seq(1500, 7, 2, 0.0)
    s.add(long)
    assert [c.num_new_tokens for c in step(s).prefills] == [BUDGET]


def test_off_schedules_exactly_as_without_a_budget() -> None:
    """Same random workload through a scheduler without a chunk budget and one with the
    flag off: the same steps, chunk for chunk."""

    def trace(s: Scheduler) -> list[list[tuple[int, int, int, int]]]:
        rng, steps, t = random.Random(3), [], 0.0
        for i in range(300):
            if rng.random() < 0.2:
                t += 1.0
                s.add(seq(rng.randint(1, 900), i, rng.randint(1, 30), t))
            if s.num_unfinished:
                out = step(s)
                chunks = [
                    (c.seq.num_prompt_tokens, c.num_new_tokens, c.num_computed_before)
                    for c in out.chunks
                ]
                steps.append([(len(out.decodes), *chunk) for chunk in chunks])
        return steps

    assert chunk_budget_for(DecodeStepTarget(), trained(), BS) is None  # what off builds
    today = trace(make(None))
    assert any(len(st) > 1 and st[-1][2] > 1 for st in today)  # prompts beside decodes
    assert today == trace(make(ChunkBudget(trained(), DecodeStepTarget(), BS)))
    assert today != trace(make(ChunkBudget(trained(), DecodeStepTarget(seconds=0.01), BS)))


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("off", DecodeStepTarget()),
        ("0", DecodeStepTarget()),
        ("auto", DecodeStepTarget(factor=AUTO_TARGET_FACTOR)),
        ("AUTO", DecodeStepTarget(factor=AUTO_TARGET_FACTOR)),
        ("40", DecodeStepTarget(seconds=0.04)),
        ("12.5", DecodeStepTarget(seconds=0.0125)),
    ],
)
def test_the_flag_reads_off_auto_and_milliseconds(value: str, want: DecodeStepTarget) -> None:
    assert parse_decode_step_target(value) == want
    assert EngineConfig(model="m", max_decode_step_ms=value).decode_step_target == want


@pytest.mark.parametrize("value", ["fast", "-5", "nan", "inf", "1e9", ""])
def test_a_bad_target_is_refused_naming_the_flag(value: str) -> None:
    with pytest.raises(ValidationError, match="--max-decode-step-ms"):
        EngineConfig(model="m", max_decode_step_ms=value)


def test_the_model_and_the_chosen_chunk_are_exported() -> None:
    metrics = EngineMetrics("m")
    model = trained()
    budget = ChunkBudget(model, DecodeStepTarget(seconds=0.03), BS)
    allowance = budget.allowance(4, 508)
    assert allowance is not None
    allowance.take(10_000, 0)
    budget.record(allowance)
    metrics.export_step_cost(model, budget)
    text = metrics.render().decode()
    for term in STEP_COST_TERMS:
        assert f'{STEP_COST_METRIC}{{model_name="m",term="{term}"}}' in text
    assert f'{PROMPT_CHUNK_METRIC}{{model_name="m"}} {float(allowance.granted)}' in text
    assert f'{DECODE_STEP_TARGET_METRIC}{{model_name="m"}} 0.03' in text
