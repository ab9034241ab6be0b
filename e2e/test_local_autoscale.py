"""The autoscaler's edges against `servefleet up` with the real engine (SmolLM2) and a scripted
load through the gateway: one client a second scales nothing; a burst scales up, no further
than the machine holds, and back down after the delay; no engine is stopped before it was
ready.

Slow (it loads the model in up to three processes): run it on its own,
    uv run pytest e2e/test_local_autoscale.py -s
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from procs import free_port

from servefleet.local.capacity import read_machine

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "llmdeployment.yaml"
ONE_CLIENT_S = float(os.environ.get("SERVEFLEET_E2E_ONE_CLIENT_S", "40"))
BURST_S = float(os.environ.get("SERVEFLEET_E2E_BURST_S", "45"))
BURST_CLIENTS = 24
SCALE_DOWN_DELAY = 10
DECISION = re.compile(r"autoscaler \S+: desired \d+ .*?: (up|down) (\d+)→(\d+)")

BURST_MANIFEST = f"""
apiVersion: servefleet.io/v1alpha1
kind: LLMDeployment
metadata: {{name: smollm2}}
spec:
  model: {{name: smollm2-135m-instruct, source: {{builtin: smollm2-135m-instruct}}}}
  engine: {{maxNumSeqs: 4, drainTimeoutSeconds: 20, resources: {{requests: {{cpu: "1"}}}}}}
  pool: {{minReplicas: 1, maxReplicas: 3, scaleDownDelay: {SCALE_DOWN_DELAY},
         perReplicaConcurrency: 4}}
  autoscaling: {{targetPerReplica: 4, queueWaitTarget: 2, interval: 1}}
  admission: {{maxQueueDepth: 64, maxQueueWait: 120}}
"""


class Up:
    """A running `servefleet up`, its console collected by a thread (so its pipe never fills)."""

    def __init__(self, manifest: Path, log_dir: Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "servefleet.cli.main",
                "up",
                str(manifest),
                "--port",
                str(self.port),
                "--log-dir",
                str(log_dir),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.warm_at = 0  # lines before "ready:" are the warm pool starting
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("ready:"):
                self.warm_at = len(self.lines)
                self.ready.set()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def key(self) -> str:
        found = [ln.split("=", 1)[1].strip() for ln in self.lines if "OPENAI_API_KEY=" in ln]
        assert found, "".join(self.lines)
        return found[0]

    def engines(self) -> int:
        """`servefleet engine` children alive now."""
        count = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError):
                continue
            if int(stat[1]) == self.proc.pid and stat[0] != "Z" and "servefleet engine" in cmd:
                count += 1
        return count

    def decisions(self) -> list[tuple[str, int, int]]:
        """Every scaling decision the console showed once warm: ("up" | "down", from, to)."""
        found = (DECISION.search(line) for line in self.lines[self.warm_at :])
        return [(m.group(1), int(m.group(2)), int(m.group(3))) for m in found if m]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=90)


@pytest.fixture
def start_up(tmp_path: Path) -> Iterator:
    started: list[Up] = []

    def start(manifest: Path) -> Up:
        up = Up(manifest, tmp_path / "logs")
        started.append(up)
        assert up.ready.wait(600), "".join(up.lines)
        return up

    yield start
    for up in started:
        up.stop()


async def _client(up: Up, until: float, pause_s: float, codes: Counter) -> None:
    body = {
        "model": "smollm2-135m-instruct",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Say hi."}],
    }
    headers = {"Authorization": f"Bearer {up.key}"}
    async with httpx.AsyncClient(timeout=180) as client:
        while time.monotonic() < until:
            sent = time.monotonic()
            r = await client.post(up.base + "/chat/completions", json=body, headers=headers)
            codes[r.status_code] += 1
            await asyncio.sleep(max(0.0, pause_s - (time.monotonic() - sent)))


async def _load(up: Up, clients: int, seconds: float, pause_s: float) -> tuple[Counter, list]:
    codes: Counter = Counter()
    sizes: list[int] = []
    until = time.monotonic() + seconds

    async def watch() -> None:
        while True:
            sizes.append(up.engines())
            await asyncio.sleep(1.0)

    watcher = asyncio.create_task(watch())
    await asyncio.gather(*(_client(up, until, pause_s, codes) for _ in range(clients)))
    watcher.cancel()
    return codes, sizes


def _stopped_before_ready(lines: list[str]) -> list[str]:
    """Replicas the supervisor drained without having seen them ready."""
    ready = {m.group(1) for ln in lines if (m := re.search(r"([\w.-]+): ready after", ln))}
    drained = {m.group(1) for ln in lines if (m := re.search(r"([\w.-]+): draining", ln))}
    return sorted(drained - ready)


def test_one_client_a_second_scales_nothing(start_up) -> None:  # type: ignore[no-untyped-def]
    """The reported `make run` case: one short request a second for 40 s on the example."""
    up = start_up(EXAMPLE)
    codes, sizes = asyncio.run(_load(up, clients=1, seconds=ONE_CLIENT_S, pause_s=1.0))
    print("status codes:", dict(codes), "engines:", sizes)
    assert codes[200] > 0 and set(codes) == {200}  # how many: as fast as this machine is
    assert set(sizes) == {1}
    assert up.decisions() == [], up.decisions()
    assert up.stop() == 0


def test_a_burst_scales_within_capacity_then_back(start_up, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    manifest = tmp_path / "burst.yaml"
    manifest.write_text(BURST_MANIFEST)
    fits = min(3, int(read_machine().cores))  # engines of one core each this machine holds
    up = start_up(manifest)
    codes, sizes = asyncio.run(_load(up, clients=BURST_CLIENTS, seconds=BURST_S, pause_s=0.0))
    deadline = time.monotonic() + SCALE_DOWN_DELAY * 3 + 90
    while up.engines() > 1 and time.monotonic() < deadline:
        sizes.append(up.engines())
        time.sleep(2)
    print("status codes:", dict(codes), "engines:", sizes, "decisions:", up.decisions())
    assert codes[200] > 0 and set(codes) <= {200, 429, 503}
    if fits >= 2:
        assert max(sizes) >= 2, "a burst on a machine with room must add an engine"
    assert max(sizes) <= fits, f"more engines than {fits} cores hold"
    assert max((to for _, _, to in up.decisions()), default=1) <= fits
    assert up.engines() == 1  # back to the warm pool after the delay
    assert _stopped_before_ready(up.lines) == []
    assert up.stop() == 0
