"""The real model through the real loop with `--max-decode-step-ms`: a long prompt that
arrives while sequences decode is split into several chunks beside them, and every answer
(greedy) is the same as without the target."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from servefleet.engine.loop import EngineRequest
from servefleet.engine.process import BuiltEngine
from servefleet.engine.protocol import new_id
from servefleet.engine.sampling_params import SamplingParams
from servefleet.engine.scheduler import SchedulerOutput
from tests.support.engine_harness import generate, running_engine, wait_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHORT = ["The capital of France is", "def fibonacci(n):", "Water boils at", "1, 2, 3,"]
LONG = "Once upon a time, in a small village by the sea, there lived an old fisherman. " * 5
DECODE = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


async def first_token_then_rest(
    built: BuiltEngine, prompt: list[int], started: asyncio.Event
) -> list[int]:
    """Greedy tokens of `prompt`; `started` is set once its first token arrived."""
    tokens: list[int] = []
    async for outs in built.engine.generate(EngineRequest(new_id("t"), prompt, DECODE)):
        for o in outs:
            tokens.extend(o.token_ids)
        started.set()
    return tokens


def run(smollm2: Any, **settings: Any) -> tuple[list[list[int]], list[SchedulerOutput]]:
    """Four decoding sequences, then the long prompt once all four decode."""
    tok = smollm2.tokenizer
    shorts = [tok.encode(t, add_special_tokens=False) for t in SHORT]
    long = tok.encode(LONG, add_special_tokens=False)
    with running_engine(smollm2, **settings) as built:
        steps: list[SchedulerOutput] = []
        schedule = built.engine.scheduler.schedule

        def recording() -> SchedulerOutput:
            out = schedule()
            steps.append(out)
            return out

        built.engine.scheduler.schedule = recording  # type: ignore[method-assign]

        async def go() -> list[list[int]]:
            events = [asyncio.Event() for _ in shorts]
            tasks = [
                asyncio.create_task(first_token_then_rest(built, p, e))
                for p, e in zip(shorts, events, strict=True)
            ]
            for e in events:
                await e.wait()
            answer = await generate(built, long, PROMPT)
            out = [*(await asyncio.gather(*tasks)), answer]
            await wait_idle(built)
            return out

        answers = asyncio.run(go())
        built.kv_cache.check_all_free()
    return answers, steps


def long_chunks(steps: list[SchedulerOutput], length: int) -> list[tuple[int, int]]:
    """(prompt tokens, decodes beside them) of each step of the long prompt's chunks."""
    return [
        (c.num_new_tokens, len(out.decodes))
        for out in steps
        for c in out.prefills
        if c.seq.num_prompt_tokens == length
    ]


def test_a_long_prompt_beside_decodes_is_chunked_and_answers_do_not_change(smollm2: Any) -> None:
    length = len(smollm2.tokenizer.encode(LONG, add_special_tokens=False))
    assert length > 64
    plain, plain_steps = run(smollm2)
    # A 1 ms target is under any decode step here: the prompt moves one block a step.
    adaptive, steps = run(smollm2, max_decode_step_ms="1")
    assert adaptive == plain
    assert long_chunks(plain_steps, length) == [(length, 4)]  # today: all in one step
    chunks = long_chunks(steps, length)
    assert len(chunks) == -(-length // 16)
    assert all(n == 16 for n, _ in chunks[:-1]) and sum(n for n, _ in chunks) == length
    assert all(decodes == 4 for _, decodes in chunks)  # every decode ran beside every chunk
