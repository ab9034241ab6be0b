"""`servefleet engine` start-up as a user meets it: a busy port fails before any heavy import,
the port answers 503 "loading" while the model loads, SIGTERM then stops it with 0, a bad
model is one line; `--api-key` (or $SERVEFLEET_API_KEY) guards every path but the probes."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from servefleet.api.engine_flags import API_KEY_ENV
from servefleet.api.engines import engine_adapter
from servefleet.bench.processes import free_port
from servefleet.cli import engine_cmd
from servefleet.engine.api_key import ApiKeyMiddleware
from servefleet.engine.config import EngineConfig
from servefleet.engine.startup_gate import StartupGate

# main() in a child, reporting whether the heavy modules were imported before it returned.
RUN_MAIN = """
import sys
from servefleet.cli.main import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "pydantic", "uvicorn") if m in sys.modules)
print("imported:", ",".join(heavy) or "-", file=sys.stderr)
sys.exit(code)
"""


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_busy_port_fails_before_torch_is_imported(busy_port: int) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", RUN_MAIN, "engine", "--model", "smollm2-135m-instruct",
         "--port", str(busy_port)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert lines[0] == (
        f"servefleet engine: error: port {busy_port} on 127.0.0.1 is already in use; stop what "
        "listens there or choose another port with --port N"
    )
    assert lines[1:] == ["imported: -"]  # nothing heavy: well under a second on an idle CPU
    assert elapsed < 10, elapsed  # the bound for a machine busy with other work


def test_bad_model_is_one_line_and_exit_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "servefleet.cli.main", "engine", "--model", "no-such-model",
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "level=error" in line]
    assert len(errors) == 1 and "unknown model 'no-such-model'" in errors[0], done.stderr


def test_port_answers_loading_then_sigterm_stops_the_start_up(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "engine.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "servefleet.cli.main", "engine", "--model",
             "smollm2-135m-instruct", "--port", str(port), "--kv-cache-memory", "64MiB"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        assert ready.status_code == 503 and ready.json() == {"ready": False, "detail": "loading"}
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 503
        chat = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={}, timeout=5)
        assert chat.status_code == 503 and chat.headers["retry-after"] == "5"
        assert "loading" in chat.json()["error"]["message"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert "stopped during start-up: signal=SIGTERM" in text and "Traceback" not in text


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    engine_cmd.add_arguments(parser)
    return parser.parse_args(["--model", "m", *argv])


def test_api_key_comes_from_the_flag_else_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_adapter("servefleet").api_key_env == API_KEY_ENV
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert EngineConfig(**engine_cmd.engine_settings(_args())).api_key is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert EngineConfig(**engine_cmd.engine_settings(_args())).api_key == "from-env"
    config = EngineConfig(**engine_cmd.engine_settings(_args("--api-key", "from-flag")))
    assert config.api_key == "from-flag" and "from-flag" not in repr(config)


def _guarded_app() -> FastAPI:
    app = FastAPI()
    for path in ("/v1/models", "/v1/chat/completions", "/health", "/ready", "/metrics"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])
    app.add_middleware(ApiKeyMiddleware, api_key="sekret")
    return app


async def test_api_key_guards_v1_and_leaves_probes_open() -> None:
    transport = httpx.ASGITransport(app=_guarded_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        for path in ("/v1/models", "/v1/chat/completions"):
            missing = await client.post(path)
            wrong = await client.post(path, headers={"Authorization": "Bearer nope"})
            right = await client.post(path, headers={"Authorization": "Bearer sekret"})
            assert (missing.status_code, wrong.status_code, right.status_code) == (401, 401, 200)
            assert missing.json()["error"]["code"] == "invalid_api_key"
        for path in ("/health", "/ready", "/metrics"):
            assert (await client.get(path)).status_code == 200


async def test_startup_gate_answers_loading_then_hands_over() -> None:
    gate = StartupGate()
    transport = httpx.ASGITransport(app=gate)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        models = await client.get("/v1/models")
        assert models.status_code == 503 and models.headers["retry-after"] == "5"
        gate.open(_guarded_app())
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/v1/models")).status_code == 401


async def test_build_app_wires_the_api_key() -> None:
    from unittest.mock import MagicMock

    from servefleet.engine.server import build_app
    from servefleet.engine.serving_state import ServingState

    engine = MagicMock()
    engine.is_healthy.return_value = (True, "ok")
    state = ServingState(
        engine=engine, tokenizer=MagicMock(), chat_template=MagicMock(),
        served_model_name="m", max_model_len=64, block_size=16, num_kv_blocks=4,
        max_queue_depth=4, ready=True, api_key="sekret",
    )  # fmt: skip
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        assert (await client.get("/v1/models")).status_code == 401
        models = await client.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"
        assert (await client.get("/ready")).status_code == 200  # probes need no key
