"""Run an engine's HTTP app in a background thread on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import openai

from servefleet.bench import processes
from servefleet.engine.process import BuiltEngine
from servefleet.engine.server import build_app


@contextmanager
def serve_in_thread(built: BuiltEngine) -> Iterator[str]:
    """The engine's app as the engine process serves it (its loop is started by `built`)."""
    with processes.serve_in_thread(build_app(built.state), lifespan="off") as url:
        yield url


def openai_client(base_url: str) -> openai.OpenAI:
    """The official client on an engine served here: no key needed, no retries to hide errors."""
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
