"""`servefleet engine` as a real process: cold start in the log, SIGTERM drains, exit 0."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from servefleet.bench.processes import free_port

MODEL = "smollm2-135m-instruct"


def wait_ready(
    url: str, proc: subprocess.Popen[bytes], timeout: float = 180, log: Path | None = None
) -> None:
    """Until the engine at `url` answers ready; its log (if given) shown when it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text() if log else "engine exited during start-up"
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("engine never became ready")


DRAIN_TOKENS = 250  # several seconds of decoding: the drain outlasts the checks below
# The drain budget only has to outlast the stream: 600 tokens take seconds on a fast CPU but
# up to a minute on a slow, busy one, and a cut stream would fail the test for the wrong reason.


def test_sigterm_drains_in_flight_then_exits_zero(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "engine.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "servefleet.cli.main", "engine", "--model", MODEL,
             "--port", str(port), "--drain-timeout", "300", "--kv-cache-memory", "256MiB"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_ready(url, proc)
        ready_line = next(line for line in log_path.read_text().splitlines() if "ready:" in line)
        cold = float(re.search(r"cold_start_s=([\d.]+)", ready_line).group(1))  # type: ignore[union-attr]
        assert cold > 0
        assert "kv_cache: blocks=" in log_path.read_text()

        events: list[str] = []
        first_chunk = threading.Event()

        def stream() -> None:
            # Long enough that the drain is still going when /ready is checked below.
            body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": DRAIN_TOKENS,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_chunk.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first_chunk.wait(120)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert httpx.get(f"{url}/ready", timeout=5).status_code == 503
        refused = httpx.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=5
        )
        assert refused.status_code == 503 and "retry-after" in refused.headers
        assert "draining" in refused.json()["error"]["message"]
        client.join(300)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == DRAIN_TOKENS  # finished, not cut off
        assert proc.wait(60) == 0
        assert "drained" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
