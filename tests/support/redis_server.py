"""A real redis-server for the tests of shared limits, budgets and batch leases."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from servefleet.bench.processes import free_port


def start_redis(port: int, persist_dir: Path | None = None) -> subprocess.Popen[bytes]:
    """A redis-server on `port`; with `persist_dir`, every write is kept there (append-only
    file, synced each time), so a server killed and started again has lost nothing."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "redis-server is not installed; the Redis limit tests need a real server "
            "(Debian: apt-get install -y redis-server)"
        )
    persist = ["--appendonly", "no"]
    if persist_dir is not None:
        persist = ["--dir", str(persist_dir), "--appendonly", "yes", "--appendfsync", "always"]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persist],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    pytest.fail("redis-server did not start")


@pytest.fixture
def redis_port() -> Iterator[int]:
    port = free_port()
    proc = start_redis(port)
    yield port
    proc.terminate()
    proc.wait(timeout=10)
