"""`servefleet up` for a newcomer: the banner comes once the warm pool is ready, so the first
request copied from it is answered 200; a busy gateway port is one line and exit status 2."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from servefleet.cli.main import main
from servefleet.local.ports import free_port
from tests.support.local_fakes import FAKE_ENGINE, MANIFEST, UP_RUNNER

READY_AFTER_S = 2.0  # the stand-in engine "loads" this long


def test_banner_waits_for_the_warm_pool_and_the_first_request_is_served(tmp_path: Path) -> None:
    manifest = tmp_path / "llmd.yaml"
    manifest.write_text(MANIFEST)
    (tmp_path / "up.py").write_text(UP_RUNNER)
    (tmp_path / "engine.py").write_text(FAKE_ENGINE)
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "up.py"), str(manifest), str(port),
         str(tmp_path / "engine.py"), str(READY_AFTER_S)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("curl "):
                break
        banner_at = time.monotonic() - started
        key = next(x for x in lines if x.startswith("export OPENAI_API_KEY=")).split("=", 1)[1]
        # The very first request, sent the moment the curl line appears.
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "tiny-model", "messages": [{"role": "user", "content": "Hello!"}]},
            headers={"Authorization": f"Bearer {key.strip()}"},
            timeout=30,
        )
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert lines[0].startswith("starting: loading warm replicas (tiny x1)"), lines
    assert banner_at >= READY_AFTER_S, "banner printed before the engine was ready"
    assert response.status_code == 200, response.text


def test_up_on_a_busy_port_is_one_line_naming_the_port(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "llmd.yaml"
    manifest.write_text(MANIFEST)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["up", str(manifest), "--port", str(port), "--log-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert f"port {port} on 127.0.0.1 is already in use" in err
    assert "--port N" in err and "Traceback" not in err
    assert not (tmp_path / "tiny-0.log").exists()  # nothing was started
