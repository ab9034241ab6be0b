"""Our engine as a child process, for the benchmark scripts.

The engine runs in its own process (as in production) so the benchmark measures the real
HTTP path, and so a crash or a hang in the engine cannot take the benchmark down with it.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from types import TracebackType

import httpx

from .processes import free_port, servefleet_command


class EngineStartError(RuntimeError):
    """The engine exited or did not become ready in time."""


def thread_env(threads: int | None) -> dict[str, str] | None:
    """The environment with OMP_NUM_THREADS set, or None (inherit) when not asked for."""
    if threads is None:
        return None
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


class EngineProcess:
    """`servefleet engine ...` on a free local port; a context manager that waits for /ready."""

    def __init__(
        self,
        model: str,
        log_path: Path,
        extra_args: list[str] | None = None,
        host: str = "127.0.0.1",
        ready_timeout_s: float = 900.0,
        env: dict[str, str] | None = None,
        command: list[str] | None = None,
        ready_path: str = "/ready",
    ) -> None:
        """`command` replaces `servefleet engine` (tests use a stand-in server); `ready_path`
        answers 200 once the server serves (another server may name it differently)."""
        self.host = host
        self.ready_path = ready_path
        self.port = free_port(host)
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.env = env
        self.argv = [
            *(command or [*servefleet_command(), "engine"]),
            "--model",
            model,
            "--host",
            host,
            "--port",
            str(self.port),
            *(extra_args or []),
        ]
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def __enter__(self) -> EngineProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self._proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env
        )
        log.close()  # the child holds its own descriptor
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        with httpx.Client(timeout=5.0) as http:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise EngineStartError(
                        f"engine exited with status {self._proc.returncode}:\n{self.log_tail()}"
                    )
                try:
                    if http.get(f"{self.base_url}{self.ready_path}").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise EngineStartError(
            f"engine not ready after {self.ready_timeout_s:g}s:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM (the engine drains), then SIGKILL if it lingers."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
