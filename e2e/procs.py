"""What the e2e tests need to start our processes: a free port and the `servefleet` command."""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def servefleet_command() -> list[str]:
    beside = Path(sys.executable).parent / "servefleet"
    return [str(beside)] if beside.is_file() else [sys.executable, "-m", "servefleet.cli.main"]
