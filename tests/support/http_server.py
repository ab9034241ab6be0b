"""Run an engine's HTTP app in a background thread on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from servefleet.bench import processes
from servefleet.engine.process import BuiltEngine
from servefleet.engine.server import build_app


@contextmanager
def serve_in_thread(built: BuiltEngine) -> Iterator[str]:
    """The engine's app as the engine process serves it (its loop is started by `built`)."""
    with processes.serve_in_thread(build_app(built.state), lifespan="off") as url:
        yield url
