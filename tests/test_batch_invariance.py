"""Batch-invariant mode on a real engine (SmolLM2, float32 CPU, in process).

The same request gives the same tokens and bitwise the same top-5 logprobs of every
output token (the first one comes from the last prompt row's logits) cold, from the
prefix cache, with every prefill chunk size, alone and among 16 concurrent requests of
other lengths, greedy and seeded. Off, the many-row path (MKL, SDPA) sums a prompt in
other orders than the decode kernels and these comparisons fail (issue 27's case).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from servefleet.engine.config import EngineConfig, EngineSettingsError
from servefleet.engine.invariance import resolve_batch_invariant
from servefleet.engine.loop import EngineRequest
from servefleet.engine.process import BuiltEngine
from servefleet.engine.protocol import new_id
from servefleet.engine.sampling_params import SamplingParams
from tests.support.engine_harness import running_engine
from tests.support.http_server import serve_in_thread

MODEL = "smollm2-135m-instruct"
TEXT = " ".join(f"Step {i}: the ferry left pier {i * 5 % 11} at dawn." for i in range(12))
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(max_tokens=4, temperature=1.0, seed=7, ignore_eos=True, logprobs=5)
CHUNKS = (1, 2, 3, 7, 16, 31, 64, 65, 128)
WHOLE = 2048

Answer = tuple[tuple[int, ...], tuple[tuple[tuple[int, float], ...], ...]]


@pytest.fixture(scope="module")
def prompt(smollm2: Any) -> list[int]:
    ids: list[int] = smollm2.tokenizer.encode(TEXT, add_special_tokens=False)
    assert 128 < len(ids) < 400  # every chunk size below cuts it
    return ids


@pytest.fixture(scope="module")
def engine(smollm2: Any) -> Iterator[BuiltEngine]:
    with running_engine(smollm2, kv_cache_memory="64MiB") as built:
        assert built.loaded.model.attn_impl.per_row_prefill  # auto: on for float32 CPU
        yield built


def _chunk(built: BuiltEngine, tokens: int) -> None:
    """The prefill chunk size (the step's token budget), set between requests."""
    scheduler = built.engine.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=tokens)


def _forget(built: BuiltEngine) -> None:
    async def go() -> None:
        await built.engine.call(built.kv_cache.pool.reset_prefix_cache)

    asyncio.run(go())


async def _one(built: BuiltEngine, prompt: list[int], params: SamplingParams) -> Answer:
    ids: list[int] = []
    tops: list[tuple[tuple[int, float], ...]] = []
    request = EngineRequest(new_id("t"), prompt, params)
    async for outs in built.engine.generate(request):
        for out in outs:
            ids.extend(out.token_ids)
            tops.extend(tuple(lp.top) for lp in out.logprobs)
    assert len(ids) == len(tops) == params.max_tokens
    return tuple(ids), tuple(tops)


def _run(built: BuiltEngine, prompts: list[list[int]]) -> list[tuple[Answer, Answer]]:
    """(greedy, seeded) answers of each prompt, all requests concurrent."""

    async def go() -> list[Answer]:
        calls = [_one(built, p, params) for p in prompts for params in (GREEDY, SEEDED)]
        return list(await asyncio.gather(*calls))

    answers = asyncio.run(go())
    return [(answers[2 * i], answers[2 * i + 1]) for i in range(len(prompts))]


def _alone(built: BuiltEngine, prompt: list[int]) -> tuple[Answer, Answer]:
    _chunk(built, WHOLE)
    _forget(built)
    return _run(built, [prompt])[0]


def test_cold_warm_and_every_chunk_size_agree(engine: BuiltEngine, prompt: list[int]) -> None:
    reference = _alone(engine, prompt)
    warm = _run(engine, [prompt])[0]  # the prompt's full blocks now come from the cache
    assert warm == reference
    for size in CHUNKS:
        _chunk(engine, size)
        _forget(engine)
        assert _run(engine, [prompt])[0] == reference, f"chunk size {size}"
    _chunk(engine, WHOLE)


def test_a_batch_of_sixteen_changes_no_answer(engine: BuiltEngine, prompt: list[int]) -> None:
    """16 requests of 8 lengths (greedy and seeded each), chunked at 64 so prompt chunks
    and decode rows share steps; each answer equals the prompt's answer alone."""
    prompts = [prompt[: 20 + 23 * i] for i in range(7)] + [prompt]
    _chunk(engine, 64)
    _forget(engine)
    together = _run(engine, prompts)
    for i in (0, 3, 7):
        assert together[i] == _alone(engine, prompts[i]), f"prompt {i}"


def test_issue_27_seeded_chat_retries_give_one_text(engine: BuiltEngine) -> None:
    _chunk(engine, WHOLE)
    _forget(engine)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a word."}],
        "temperature": 1,
        "seed": 7,
        "max_tokens": 16,
    }
    texts, cached = [], []
    with serve_in_thread(engine) as url:
        for _ in range(4):
            response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            reply = response.json()
            texts.append(reply["choices"][0]["message"]["content"])
            cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    assert texts == [texts[0]] * 4, texts


def test_the_setting_resolves_and_refuses(smollm2: Any) -> None:
    model = smollm2.model
    assert resolve_batch_invariant("auto", model) is True
    assert resolve_batch_invariant("off", model) is False
    assert EngineConfig(model=MODEL).batch_invariant == "auto"
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(model=MODEL, batch_invariant="yes")  # type: ignore[arg-type]
    matmul = model.matmul
    try:
        model.set_matmul(dataclasses.replace(matmul, bf16_min_rows=8, invariant=False))
        assert resolve_batch_invariant("auto", model) is False
        with pytest.raises(EngineSettingsError, match="--batch-invariant on: --matmul-dtype"):
            resolve_batch_invariant("on", model)
    finally:
        model.set_matmul(matmul)
