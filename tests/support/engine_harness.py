"""Drive a real Engine (thread + scheduler + model) from asyncio tests, no HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from servefleet.engine.config import EngineConfig
from servefleet.engine.loop import EngineRequest
from servefleet.engine.model.loader import LoadedModel
from servefleet.engine.process import BuiltEngine, build_engine
from servefleet.engine.protocol import new_id
from servefleet.engine.sampling_params import SamplingParams


def make_engine(loaded: LoadedModel, **settings: Any) -> BuiltEngine:
    config = EngineConfig(model="smollm2-135m-instruct", device="cpu", **settings)
    built = build_engine(config, loaded)
    built.engine.start()
    built.state.ready = True
    return built


@contextmanager
def running_engine(loaded: LoadedModel, **settings: Any) -> Iterator[BuiltEngine]:
    """`make_engine` for a fixture: the engine thread is stopped when the block ends."""
    built = make_engine(loaded, **settings)
    try:
        yield built
    finally:
        built.engine.stop()


async def generate(
    built: BuiltEngine, prompt: list[int], params: SamplingParams, priority: int = 0
) -> list[int]:
    tokens: list[int] = []
    request = EngineRequest(new_id("t"), prompt, params, priority=priority)
    async for outs in built.engine.generate(request):
        for o in outs:
            tokens.extend(o.token_ids)
    return tokens


async def generate_all(
    built: BuiltEngine, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    return list(await asyncio.gather(*(generate(built, p, params) for p in prompts)))


async def wait_idle(built: BuiltEngine, timeout: float = 5.0) -> None:
    """Until the engine thread has processed every abort and finished every sequence."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while built.engine.scheduler.num_unfinished or not built.engine._inbox.empty():
        if loop.time() > deadline:
            raise AssertionError("engine did not go idle")
        await asyncio.sleep(0.01)
