"""Local mode with real processes: the supervisor and the whole plane, against a tiny engine
(tests/support/local_fakes.py). The real engine's local e2e lives in e2e/test_local_*.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from servefleet.api.llmdeployment import LLMDeployment, LLMDeploymentSpec
from servefleet.api.manifests import load_llmdeployments
from servefleet.autoscaler.signals import ReplicaState
from servefleet.local.engine_command import engine_command
from servefleet.local.plane import LocalControlPlane, LocalOptions, banner
from servefleet.local.ports import free_port
from servefleet.local.supervisor import DeploymentSupervisor
from servefleet.local.tenants import resolve_local_tenants
from tests.support.local_fakes import FAKE_ENGINE, MANIFEST, UP_RUNNER


@pytest.fixture
def fake_engine(tmp_path: Path) -> Path:
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    return script


async def _until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), timeout_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


async def test_supervisor_starts_drains_replaces_and_stops(fake_engine: Path, tmp_path: Path):
    published: list[tuple[list[str], list[str]]] = []
    sup = DeploymentSupervisor(
        "tiny",
        lambda port: [sys.executable, str(fake_engine), str(port), "0.3"],
        log_dir=tmp_path / "logs",
        on_change=lambda all_, ready: published.append((all_, ready)),
        poll_interval_s=0.05,
    )
    runner = asyncio.create_task(sup.run())
    try:
        sup.scale(2)
        await _until(lambda: sum(r.state is ReplicaState.READY for r in sup.live()) == 2)
        assert len({r.port for r in sup.live()}) == 2
        assert published[-1][1] == [r.base_url for r in sup.live()]

        # A request in flight on the victim finishes before it exits 0.
        victim = sup.live()[0]
        async with httpx.AsyncClient() as client:
            call = asyncio.create_task(
                client.post(victim.base_url + "/v1/chat/completions", json={"max_tokens": 10})
            )
            await _until(lambda: victim.process.returncode is None and _running(victim.base_url))
            sup.scale(1, victim=victim.name)
            response = await call
        assert response.status_code == 200
        await _until(lambda: victim.name not in sup.replicas)
        assert victim.process.returncode == 0
        assert [e.event for e in sup.timeline if e.replica == victim.name][-2:] == [
            "draining (SIGTERM)",
            "exited 0",
        ]

        # A replica that dies is replaced, keeping the desired size.
        survivor = sup.live()[0]
        survivor.process.kill()
        await _until(lambda: survivor.name not in sup.replicas)
        await _until(lambda: sum(r.state is ReplicaState.READY for r in sup.live()) == 1)
        assert sup.live()[0].name != survivor.name
    finally:
        pids = list(sup.pids().values())
        await sup.stop()
        runner.cancel()
    assert pids and not any(_alive(pid) for pid in pids)


def _running(base_url: str) -> bool:
    text = httpx.get(base_url + "/metrics").text
    return 'vllm:num_requests_running{model_name="m"} 1' in text


def test_engine_command_shows_servefleet_engine() -> None:
    dep = _deployment(Path("unused"), MANIFEST)
    argv = engine_command(dep.spec, "127.0.0.1", 8123)
    line = " ".join(argv)
    assert "servefleet engine --model smollm2-135m-instruct" in line
    assert "--served-model-name tiny-model" in line and "--port 8123" in line


def test_engine_command_rejects_what_local_mode_cannot_run() -> None:
    spec = LLMDeploymentSpec.model_validate(
        {"model": {"name": "m", "source": {"url": "https://example.com/m.gguf"}}}
    )
    with pytest.raises(ValueError, match=r"pvc\.path"):
        engine_command(spec, "127.0.0.1", 1)


def _deployment(tmp: Path, text: str) -> LLMDeployment:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    try:
        return load_llmdeployments(f.name)[0]
    finally:
        os.unlink(f.name)


async def test_plane_serves_through_gateway_and_scales_with_load(fake_engine: Path, tmp_path):
    manifest = tmp_path / "llmd.yaml"
    manifest.write_text(MANIFEST)
    deployments = load_llmdeployments(manifest)
    tenants = resolve_local_tenants(deployments, manifest)
    port = free_port()
    plane = LocalControlPlane(
        tenants.deployments,
        tenants,
        LocalOptions(
            log_dir=tmp_path / "logs",
            port=port,
            engine_command=lambda spec, host, p: [sys.executable, str(fake_engine), str(p), "0.2"],
        ),
    )
    await plane.start()
    try:
        await plane.wait_warm(20)
        text = banner(plane)
        assert f"export OPENAI_BASE_URL=http://127.0.0.1:{port}/v1" in text
        assert f"export OPENAI_API_KEY={tenants.demo_key}" in text
        sup = plane.supervisors["tiny"]
        headers = {"Authorization": f"Bearer {tenants.demo_key}"}
        body = {"model": "tiny-model", "messages": [{"role": "user", "content": "x"}]}
        async with httpx.AsyncClient(base_url=plane.base_url, timeout=30) as client:
            denied = await client.post("/chat/completions", json=body)
            assert denied.status_code == 401
            ok = await client.post("/chat/completions", json=body, headers=headers)
            assert ok.status_code == 200, ok.text

            sizes: list[int] = []

            async def load() -> list[int]:
                calls = [
                    client.post(
                        "/chat/completions", json={**body, "max_tokens": 40}, headers=headers
                    )
                    for _ in range(12)
                ]
                return [r.status_code for r in await asyncio.gather(*calls)]

            async def watch() -> None:
                while True:
                    sizes.append(len(sup.live()))
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            codes = await load()
            assert set(codes) <= {200, 429, 503} and 200 in codes
            assert max(sizes) >= 2  # the pool grew under load
            await _until(lambda: len(sup.live()) == 1, timeout_s=30)  # and came back
            watcher.cancel()
        decisions = plane.metrics.render().decode()
        assert (
            'servefleet_autoscaler_decisions_total{deployment="tiny",reason="demand"}' in decisions
        )
    finally:
        pids = [pid for s in plane.supervisors.values() for pid in s.pids().values()]
        await plane.stop()
    assert not any(_alive(pid) for pid in pids)


def test_up_rejects_a_bad_manifest(tmp_path: Path) -> None:
    from servefleet.cli.main import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(MANIFEST.replace("maxReplicas: 3", "maxReplicas: 0"))
    assert main(["up", str(bad)]) == 2


def test_up_stops_every_process_on_sigint(fake_engine: Path, tmp_path: Path) -> None:
    """Ctrl-C on `servefleet up`: every engine it started is gone, and it exits 0."""
    import subprocess
    import time

    manifest = tmp_path / "llmd.yaml"
    manifest.write_text(MANIFEST)
    runner = tmp_path / "up.py"
    runner.write_text(UP_RUNNER)
    proc = subprocess.Popen(
        [sys.executable, str(runner), str(manifest), str(free_port()), str(fake_engine)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("export OPENAI_API_KEY="):
            break
    time.sleep(1.0)
    children = _children(proc.pid)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, "".join(lines) + out
    assert "stopped" in out
    assert children, "servefleet up started no engine process"
    assert not any(_alive(pid) for pid in children)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().split()[3]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found
