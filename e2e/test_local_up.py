"""`servefleet up` with the real engine (SmolLM2) as real processes: an engine killed under load
is replaced; Ctrl-C stops all. (A load step growing the pool and shrinking it back after the
delay is `test_local_autoscale.py`'s burst.)

Slow (it loads the model in up to three processes): run it on its own,
    uv run pytest e2e/test_local_up.py -s
LOAD_SECONDS and CLIENTS can be lowered through SERVEFLEET_E2E_LOAD_S / _CLIENTS.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from procs import free_port as _free_port

Up = tuple["subprocess.Popen[str]", str, str]
LOAD_SECONDS = float(os.environ.get("SERVEFLEET_E2E_LOAD_S", "30"))
CLIENTS = int(os.environ.get("SERVEFLEET_E2E_CLIENTS", "30"))
SCALE_DOWN_DELAY = 10
REQUEST_TIMEOUT = 180.0

MANIFEST = f"""
apiVersion: servefleet.io/v1alpha1
kind: LLMDeployment
metadata: {{name: smollm2}}
spec:
  model: {{name: smollm2, source: {{builtin: smollm2-135m-instruct}}}}
  engine: {{maxNumSeqs: 4, drainTimeoutSeconds: 20}}
  pool: {{minReplicas: 1, maxReplicas: 3, scaleDownDelay: {SCALE_DOWN_DELAY},
         perReplicaConcurrency: 4}}
  autoscaling: {{targetPerReplica: 4, interval: 1}}
  admission: {{maxQueueDepth: 64, maxQueueWait: 60}}
"""


def _engines(parent: int) -> list[int]:
    """PIDs of `servefleet engine` processes started by `parent`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and "servefleet engine" in cmd and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    manifest = tmp_path / "llmd.yaml"
    manifest.write_text(MANIFEST)
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "servefleet.cli.main",
            "up",
            str(manifest),
            "--port",
            str(port),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    key, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("export OPENAI_API_KEY="):
            key = line.split("=", 1)[1].strip()
        if line.startswith("ready:"):
            break
    assert key, "".join(lines)
    yield proc, f"http://127.0.0.1:{port}/v1", key
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


async def _client_loop(base: str, key: str, until: float, codes: Counter) -> None:
    body = {
        "model": "smollm2",
        "stream": True,
        "max_tokens": 24,
        "messages": [{"role": "user", "content": "Count from one to ten."}],
    }
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as client:
        while time.monotonic() < until:
            async with client.stream(
                "POST",
                base + "/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
            ) as r:
                async for _ in r.aiter_bytes():
                    pass
                codes[r.status_code] += 1
                if r.status_code == 503:
                    assert "retry-after" in r.headers, "503 without Retry-After"
                    await asyncio.sleep(min(5.0, float(r.headers["retry-after"])))
                elif r.status_code == 429:
                    await asyncio.sleep(1.0)


async def _load(
    base: str, key: str, seconds: float, timeline: list, pid: int, kill_at: float | None = None
) -> Counter:
    codes: Counter = Counter()
    until = time.monotonic() + seconds
    start = time.monotonic()
    killed = False

    async def watch() -> None:
        nonlocal killed
        while True:
            engines = _engines(pid)
            timeline.append((round(time.monotonic() - start, 1), len(engines)))
            if kill_at is not None and not killed and time.monotonic() - start > kill_at:
                os.kill(engines[0], signal.SIGKILL)
                killed = True
                timeline.append((round(time.monotonic() - start, 1), f"killed 1 of {len(engines)}"))
            await asyncio.sleep(1.0)

    watcher = asyncio.create_task(watch())
    await asyncio.gather(*(_client_loop(base, key, until, codes) for _ in range(CLIENTS)))
    watcher.cancel()
    return codes


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def _print_timeline(title: str, timeline: list) -> None:
    print(f"\n{title}: (seconds, engine processes)")
    print(" ".join(f"{t}s:{n}" for t, n in timeline))


def test_killed_engine_is_replaced_under_load(up: Up) -> None:
    proc, base, key = up
    timeline: list = []
    codes = asyncio.run(
        _load(base, key, LOAD_SECONDS, timeline, proc.pid, kill_at=LOAD_SECONDS / 2)
    )
    _print_timeline("kill under load", timeline)
    print("status codes:", dict(codes))
    assert set(codes) <= {200, 429, 502, 503} and codes[200] > 0
    kill = next(i for i, (_, n) in enumerate(timeline) if str(n).startswith("killed"))
    before = int(str(timeline[kill][1]).rsplit(" ", 1)[1])
    # The supervisor starts a replacement at once: the process count is back where it was.
    assert max(n for _, n in timeline[kill + 1 :] if isinstance(n, int)) >= before
    children = _engines(proc.pid)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    assert not [c for c in children if _alive(c)], "engines left running after Ctrl-C"
