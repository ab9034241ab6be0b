"""What the e2e tests need to start our processes: a free port and the `servefleet` command."""

from __future__ import annotations

from servefleet.bench.processes import free_port, servefleet_command

__all__ = ["free_port", "servefleet_command"]
