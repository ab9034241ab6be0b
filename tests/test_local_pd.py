"""Local mode with spec.disaggregation: the prefill pool's processes run on the ports the
gateway's config names (GatewayDeployment.prefill.endpoints), beside the decode pool, and
stop with the plane. Against the tiny fake engine (tests/support/local_fakes.py)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from servefleet.api.llmdeployment import LLMDeployment
from servefleet.api.manifests import load_llmdeployments
from servefleet.autoscaler.signals import ReplicaState
from servefleet.local.engine_command import engine_command
from servefleet.local.plane import LocalControlPlane, LocalOptions, banner
from servefleet.local.ports import free_port
from servefleet.local.tenants import resolve_local_tenants
from tests.support.local_fakes import FAKE_ENGINE, MANIFEST

PD_MANIFEST = MANIFEST.rstrip() + (
    "\n  disaggregation: {threshold: 64, prefill: {replicas: 2, maxReplicas: 2, "
    "args: [--max-num-batched-tokens, '512']}}\n"
)


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


def _dep(tmp_path: Path) -> tuple[list[LLMDeployment], Path]:
    manifest = tmp_path / "pd.yaml"
    manifest.write_text(PD_MANIFEST)
    return load_llmdeployments(manifest), manifest


def test_a_prefill_replica_runs_the_real_engine_with_its_own_args(tmp_path: Path) -> None:
    (dep,), _ = _dep(tmp_path)
    decode = engine_command(dep.spec, "127.0.0.1", 9001, role="decode")
    prefill = engine_command(dep.spec, "127.0.0.1", 9002, role="prefill")
    assert prefill[-2:] == ["--max-num-batched-tokens", "512"]
    assert "512" not in decode
    assert prefill[: len(decode) - 2][:3] == decode[:3]  # same executable and subcommand


async def test_up_runs_the_prefill_pool_on_the_ports_its_route_names(
    fake_engine: Path, tmp_path: Path
) -> None:
    deployments, manifest = _dep(tmp_path)
    tenants = resolve_local_tenants(deployments, manifest)
    plane = LocalControlPlane(
        tenants.deployments,
        tenants,
        LocalOptions(
            log_dir=tmp_path / "logs",
            port=free_port(),
            engine_command=lambda spec, host, p: [sys.executable, str(fake_engine), str(p), "0"],
        ),
    )
    await plane.start()
    try:
        await plane.wait_warm(30)
        prefill = plane.prefill_supervisors["tiny"]
        ports = plane.prefill_ports["tiny"]
        assert len(ports) == 2
        assert sorted(r.port for r in prefill.live()) == sorted(ports)
        assert all(r.name.startswith("tiny-prefill-") for r in prefill.live())
        (routed,) = plane.gateway_config().deployments
        assert routed.prefill is not None
        assert routed.prefill.endpoints == [f"http://127.0.0.1:{p}" for p in ports]
        assert (routed.prefill.threshold, routed.prefill.protocol) == (64, "servefleet")
        assert "prefill pool: 2 replicas (prompts of 64+ uncached tokens" in banner(plane)
        # The decode pool is the deployment's own, on other ports.
        decode_ports = {r.port for r in plane.supervisors["tiny"].live()}
        assert decode_ports and not decode_ports & set(ports)

        # A prefill replica that dies is replaced on the port the route names.
        victim = prefill.live()[0]
        victim.process.kill()
        await _until(lambda: victim.name not in prefill.replicas)
        await _until(lambda: sum(r.state is ReplicaState.READY for r in prefill.live()) == 2, 30)
        assert sorted(r.port for r in prefill.live()) == sorted(ports)
    finally:
        pids = [
            pid
            for s in [*plane.supervisors.values(), *plane.prefill_supervisors.values()]
            for pid in s.pids().values()
        ]
        await plane.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
