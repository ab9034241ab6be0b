"""Starting servers for benchmarks, tests and whole-system tests: a free port, the
`servefleet` command of this environment, an ASGI app on a background thread.

One copy for every caller, so a change (a different loopback address, a new way to find
the command) is made once.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (another process may still take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def servefleet_command() -> list[str]:
    """The `servefleet` script beside this interpreter, else on PATH, else `python -m`."""
    beside = Path(sys.executable).parent / "servefleet"
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("servefleet")
    return [found] if found else [sys.executable, "-m", "servefleet.cli.main"]


@contextlib.contextmanager
def serve_in_thread(
    app: Any, port: int | None = None, *, lifespan: Literal["on", "off"] = "on"
) -> Iterator[str]:
    """Run an ASGI app with uvicorn on a background thread; yields its base URL."""
    import uvicorn

    port = port or free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan=lifespan,
        http="httptools",
        loop="asyncio",
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
