"""The real model through the real engine loop: batching must not change answers.

Each request's greedy output must be the same alone, among 16 concurrent
requests of different lengths, with prefix caching on or off, after being
preempted, and with speculative decoding; and every block must be back in the
pool afterwards.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from servefleet.engine.kv_plan import resolve_kv_cache_dtype
from servefleet.engine.sampling_params import SamplingParams
from tests.support.engine_harness import generate, generate_all, make_engine, wait_idle

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three primary colors:",
    "Water boils at",
    "Translate to French: good morning",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5,",
    "Photosynthesis is the process by which plants convert sunlight, water and carbon dioxide",
    "A haiku about autumn:",
    "SELECT name FROM users WHERE",
    "The three laws of motion were formulated by",
    "In 1969, the first humans to walk on the Moon were",
    "import numpy as np\nx = np.",
    "My favourite book is",
    "The largest planet in the solar system is Jupiter. The smallest planet is",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
# Propose at every chance, in batches too, so verification and roll-back run often.
EAGER_NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, '
    '"disable_by_batch_size": null, "min_acceptance_rate": 0.0}'
)


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:  # type: ignore[no-untyped-def]
    ids = [smollm2.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    assert len({len(p) for p in ids}) > 8, "prompts must have varied lengths"
    return ids


@pytest.fixture(scope="module")
def alone(smollm2, prompts) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Reference: each prompt on its own, on an engine that never shares a step."""
    built = make_engine(smollm2, enable_prefix_caching=False, max_num_seqs=1)
    try:

        async def one_by_one() -> list[list[int]]:
            return [await generate(built, p, GREEDY) for p in prompts]

        out = asyncio.run(one_by_one())
        built.kv_cache.check_all_free()
        return out
    finally:
        built.engine.stop()


def run_concurrently(smollm2, prompts, params=GREEDY, one_by_one=False, **settings):  # type: ignore[no-untyped-def]
    built = make_engine(smollm2, **settings)
    try:

        async def go() -> list[list[int]]:
            if one_by_one:
                out = [await generate(built, p, params) for p in prompts]
            else:
                out = await generate_all(built, prompts, params)
            await wait_idle(built)
            return out

        return asyncio.run(go()), built
    finally:
        built.engine.stop()


def test_sixteen_concurrent_match_alone(smollm2, prompts, alone) -> None:  # type: ignore[no-untyped-def]
    outputs, built = run_concurrently(smollm2, prompts, max_num_batched_tokens=96)
    assert outputs == alone
    assert all(len(o) == 32 for o in outputs)
    built.kv_cache.check_all_free()


def test_prefix_caching_on_and_off_match(smollm2, prompts, alone) -> None:  # type: ignore[no-untyped-def]
    system = smollm2.tokenizer.encode(
        "You are a careful assistant. Answer briefly and precisely, and never invent facts. " * 3,
        add_special_tokens=False,
    )
    shared = [system + p for p in prompts[:8]]
    on, built_on = run_concurrently(smollm2, shared + shared, max_num_seqs=8)
    off, built_off = run_concurrently(smollm2, shared + shared, enable_prefix_caching=False)
    assert on == off
    assert on[:8] == on[8:]
    assert built_on.kv_cache.prefix_hits > len(system) * 8
    assert built_off.kv_cache.prefix_hits == 0
    built_on.kv_cache.check_all_free()
    built_off.kv_cache.check_all_free()


def test_preempted_requests_resume_with_the_same_output(smollm2, prompts, alone) -> None:  # type: ignore[no-untyped-def]
    # 30 blocks of 16 tokens (in the default KV-cache dtype) cannot hold 16 sequences of
    # ~45 tokens.
    element = torch.empty(0, dtype=resolve_kv_cache_dtype("auto", torch.float32)).element_size()
    outputs, built = run_concurrently(
        smollm2, prompts, kv_cache_memory=str(30 * 16 * 30 * 2 * 3 * 64 * element)
    )
    assert built.engine.scheduler.num_preemptions > 0
    assert outputs == alone
    built.kv_cache.check_all_free()


def test_seeded_sampling_is_reproducible_in_any_batch(smollm2, prompts) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    built = make_engine(smollm2)
    try:

        async def go() -> tuple[list[int], list[list[int]], list[int]]:
            solo = await generate(built, prompts[0], params)
            crowd = await generate_all(built, [prompts[0], *prompts[1:8]], params)
            other_seed = SamplingParams(
                max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=99
            )
            different = await generate(built, prompts[0], other_seed)
            await wait_idle(built)
            return solo, crowd, different

        solo, crowd, different = asyncio.run(go())
    finally:
        built.engine.stop()
    assert solo == crowd[0]
    assert solo != different
    built.kv_cache.check_all_free()


def test_seeded_sampling_survives_preemption(smollm2, prompts) -> None:  # type: ignore[no-untyped-def]
    """Counter-based draws: a preempted, recomputed sequence samples what it would have."""
    params = SamplingParams(max_tokens=32, temperature=1.0, top_k=40, seed=77, ignore_eos=True)
    element = torch.empty(0, dtype=resolve_kv_cache_dtype("auto", torch.float32)).element_size()

    def run(**settings):  # type: ignore[no-untyped-def]
        built = make_engine(smollm2, **settings)
        try:

            async def go() -> list[list[int]]:
                out = await generate_all(built, prompts, params)
                await wait_idle(built)
                return out

            return asyncio.run(go()), built
        finally:
            built.engine.stop()

    roomy, _ = run()
    tight, built = run(kv_cache_memory=str(30 * 16 * 30 * 2 * 3 * 64 * element))
    assert built.engine.scheduler.num_preemptions > 0
    assert tight == roomy
    built.kv_cache.check_all_free()


def accepted_tokens(built) -> float:  # type: ignore[no-untyped-def]
    return built.engine.metrics.spec_accepted_tokens._value.get()  # type: ignore[no-any-return]


def test_speculative_decoding_matches_alone_and_batched(smollm2, prompts, alone) -> None:  # type: ignore[no-untyped-def]
    solo, built_solo = run_concurrently(
        smollm2, prompts, one_by_one=True, max_num_seqs=1, speculative_config=EAGER_NGRAM
    )
    crowd, built_crowd = run_concurrently(
        smollm2, prompts, max_num_batched_tokens=96, speculative_config=EAGER_NGRAM
    )
    assert solo == alone
    assert crowd == alone
    for built in (built_solo, built_crowd):
        assert accepted_tokens(built) > 20
        assert built.engine.metrics.spec_draft_tokens._value.get() > accepted_tokens(built)
        built.kv_cache.check_all_free()


def test_speculation_stops_where_a_plain_run_stops(smollm2, prompts) -> None:  # type: ignore[no-untyped-def]
    """Stop strings and stop ids met inside an accepted proposal end the output exactly
    where a plain run ends it, tokens and usage alike."""
    from servefleet.engine.loop import EngineRequest

    params = SamplingParams(max_tokens=32, temperature=0.0, stop=(" the",), stop_token_ids=(13,))

    def run(**settings):  # type: ignore[no-untyped-def]
        built = make_engine(smollm2, max_num_seqs=1, **settings)

        async def one(i: int, prompt: list[int]) -> tuple[list[int], int, str]:
            tokens, usage, text = [], 0, ""
            async for outs in built.engine.generate(EngineRequest(f"r{i}", prompt, params)):
                for o in outs:
                    tokens += o.token_ids
                    usage, text = o.num_output_tokens, text + o.text
            return tokens, usage, text

        async def go() -> list[tuple[list[int], int, str]]:
            return [await one(i, p) for i, p in enumerate(prompts)]

        try:
            return asyncio.run(go()), built
        finally:
            built.engine.stop()

    plain, _ = run()
    spec, built = run(speculative_config=EAGER_NGRAM)
    assert spec == plain
    assert all(usage == len(tokens) for tokens, usage, _ in spec)
    assert any(usage < 32 for _, usage, _ in plain)
    built.kv_cache.check_all_free()


def test_seeded_speculative_decoding_matches_plain_sampling(smollm2, prompts) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.95, seed=5, ignore_eos=True)
    plain, _ = run_concurrently(smollm2, prompts[:8], params)
    spec, built = run_concurrently(smollm2, prompts[:8], params, speculative_config=EAGER_NGRAM)
    assert spec == plain
    assert accepted_tokens(built) > 5
    built.kv_cache.check_all_free()


def test_abort_frees_blocks_within_a_step(smollm2, prompts) -> None:  # type: ignore[no-untyped-def]
    built = make_engine(smollm2)
    try:

        async def go() -> None:
            from servefleet.engine.loop import EngineRequest

            long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
            request = EngineRequest("abort-me", prompts[2], long)
            stream = built.engine.generate(request)
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
            await stream.aclose()  # what a disconnecting client's handler does
            assert built.kv_cache.usage > 0 or built.engine.scheduler.num_unfinished == 0
            await wait_idle(built, timeout=2.0)

        asyncio.run(go())
    finally:
        built.engine.stop()
    built.kv_cache.check_all_free()
    finished = built.engine.metrics.requests_finished.labels(
        model_name="smollm2-135m-instruct", finished_reason="abort"
    )
    assert finished._value.get() == 1
