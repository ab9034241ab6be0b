"""The engine's HTTP side: uvicorn on its own thread, serving from before the model loads.

torch-free on purpose: `servefleet engine` starts this right after binding its port, so the
port answers "loading" (see startup_gate) while torch is imported and the model loads, and
SIGTERM/SIGINT in that window end the process at once (exit 0). Once the engine is built, the gate
opens onto the real app and a signal drains instead: stop admitting, finish in-flight, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from servefleet.api.http_protocol import BoundedHeadProtocol
from servefleet.engine.config import EngineConfig
from servefleet.engine.startup_gate import StartupGate

if TYPE_CHECKING:
    from servefleet.engine.serving_state import ServingState

log = logging.getLogger("servefleet.engine")


class DrainingServer(uvicorn.Server):
    """uvicorn that drains on SIGTERM/SIGINT: stop admitting, finish in-flight, exit 0.

    It serves from before the model loads (`serving` is None then); a signal in that
    window ends the process at once with status 0, as nothing is in flight (an exception
    raised into the main thread mid-import would leave torch or numpy half-imported).
    """

    def __init__(self, config: uvicorn.Config, drain_timeout: float) -> None:
        super().__init__(config)
        self.serving: ServingState | None = None
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.serving is None:  # still loading
            log.info("stopped during start-up: signal=%s", signal.Signals(sig).name)
            os._exit(0)
        if self.serving.draining or self._loop is None:
            self.should_exit = True
            if sig == signal.SIGINT and self.serving.draining:
                self.force_exit = True
            return
        self.serving.draining = True
        self.serving.engine.metrics.draining.set(1)
        log.info(
            "draining: signal=%s in_flight=%d timeout_s=%.0f",
            signal.Signals(sig).name,
            self.serving.engine.num_in_flight,
            self.drain_timeout,
        )
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        assert self.serving is not None
        deadline = time.monotonic() + self.drain_timeout
        engine = self.serving.engine
        while engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            log.warning(
                "drain timeout: %d requests still in flight, stopping", engine.num_in_flight
            )
        else:
            log.info("drained: all in-flight requests finished")
        self.should_exit = True


@dataclass
class EngineHttpServer:
    """What `serve` needs of the HTTP side: the server, its gate, and the thread it runs on."""

    server: DrainingServer
    gate: StartupGate
    thread: threading.Thread


def start_http_server(config: EngineConfig, listener: socket.socket) -> EngineHttpServer:
    """uvicorn on its own thread and loop, on the bound `listener`, answering "loading"
    until the gate opens; signals reach the main thread and are routed to the server."""
    gate = StartupGate()
    uv_config = uvicorn.Config(
        gate,
        log_config=None,  # the root handler of servefleet.cli.logs
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=max(1, int(config.drain_timeout)),
        lifespan="off",
        http=BoundedHeadProtocol,  # slow or huge request heads, and slow bodies, are cut
    )
    server = DrainingServer(uv_config, config.drain_timeout)

    def server_thread() -> None:
        try:
            asyncio.run(server.serve([listener]))
        except BaseException:
            log.exception("http server failed")
        finally:
            if server.serving is not None:
                server.serving.engine.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    http = threading.Thread(target=server_thread, name="http-server", daemon=True)
    http.start()
    return EngineHttpServer(server, gate, http)
