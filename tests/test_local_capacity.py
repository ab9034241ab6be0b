"""Local mode knows the machine: engines that would not fit are not asked for."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from servefleet.api.engine_resources import parse_cpu
from servefleet.api.llmdeployment import LLMDeploymentSpec
from servefleet.api.manifests import load_llmdeployments
from servefleet.autoscaler.signals import ReplicaState
from servefleet.local.capacity import (
    LocalCapacity,
    MachineResources,
    footprint_from_spec,
    read_machine,
)
from servefleet.local.plane import LocalControlPlane, LocalOptions
from servefleet.local.ports import free_port
from servefleet.local.tenants import resolve_local_tenants

from .test_local_mode import MANIFEST, fake_engine  # noqa: F401 (fixture)

GIB = 1024**3


def _spec(resources: dict[str, Any] | None = None) -> LLMDeploymentSpec:
    return LLMDeploymentSpec.model_validate(
        {
            "model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}},
            "engine": {"resources": resources or {}},
        }
    )


def _pool(*states: ReplicaState, first_pid: int = 100) -> Any:
    """A supervisor stand-in: its live engines, each with a pid and a state."""
    replicas = [
        SimpleNamespace(state=s, exited=False, process=SimpleNamespace(pid=first_pid + i))
        for i, s in enumerate(states)
    ]
    return SimpleNamespace(live=lambda: replicas)


def test_cpu_quantities_and_the_spec_footprint() -> None:
    assert (parse_cpu("500m"), parse_cpu(2), parse_cpu("1.5")) == (0.5, 2.0, 1.5)
    assert footprint_from_spec(_spec()).model_dump() == {"cores": 1.0, "memory_bytes": None}
    fp = footprint_from_spec(_spec({"requests": {"cpu": "500m", "memory": "2Gi"}}))
    assert (fp.cores, fp.memory_bytes) == (0.5, 2 * GIB)
    limits_only = footprint_from_spec(_spec({"limits": {"cpu": 3, "memory": "1Gi"}}))
    assert (limits_only.cores, limits_only.memory_bytes) == (3.0, GIB)


def test_cores_left_after_every_deployments_engines() -> None:
    capacity = LocalCapacity(machine=lambda: MachineResources(cores=4), resident=lambda _: None)
    a = _pool(ReplicaState.READY)
    capacity.add("a", _spec(), a)
    assert capacity.free_replicas("a") == 3
    # A second deployment of 2-core engines on the same machine: they share the four cores.
    b = _pool(ReplicaState.READY, first_pid=200)
    capacity.add("b", _spec({"requests": {"cpu": "2"}}), b)
    assert (capacity.free_replicas("a"), capacity.free_replicas("b")) == (1, 0)
    a.live().append(SimpleNamespace(state=ReplicaState.STARTING, exited=False, process=None))
    assert capacity.free_replicas("a") == 0  # a starting engine takes its core already


def test_memory_measured_from_ready_engines_and_reserved_for_loading_ones() -> None:
    machine = MachineResources(cores=16, memory_available_bytes=5 * GIB)
    capacity = LocalCapacity(machine=lambda: machine, resident=lambda pid: 2 * GIB)
    # Nothing ready yet: the spec's request is all there is to go by.
    capacity.add("m", _spec({"requests": {"memory": "1Gi"}}), _pool(ReplicaState.STARTING))
    assert capacity.engine_memory("m") == GIB
    assert capacity.free_replicas("m") == 4  # (5 - 1 loading) / 1
    # Once one is ready its measured size counts: 2 GiB, and the loading one will take 2 more.
    capacity.add(
        "m",
        _spec({"requests": {"memory": "1Gi"}}),
        _pool(ReplicaState.READY, ReplicaState.STARTING),
    )
    assert capacity.engine_memory("m") == 2 * GIB
    assert capacity.free_replicas("m") == 1  # (5 - 2) // 2
    unknown = LocalCapacity(machine=lambda: MachineResources(cores=2), resident=lambda _: None)
    unknown.add("m", _spec(), _pool(ReplicaState.READY))
    assert unknown.free_replicas("m") == 1  # memory unknown: cores alone decide


def test_this_machine_is_read() -> None:
    machine = read_machine()
    assert machine.cores >= 0.01
    if sys.platform.startswith("linux"):
        assert machine.memory_available_bytes is not None
        assert machine.memory_available_bytes > 0


async def test_a_full_machine_adds_no_engine_however_long_the_queue(
    fake_engine: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The busy-machine case end to end: one core, a queue and slow answers, and the pool
    stays at one engine, saying why."""
    manifest = tmp_path / "llmd.yaml"
    manifest.write_text(MANIFEST)
    deployments = load_llmdeployments(manifest)
    tenants = resolve_local_tenants(deployments, manifest)
    plane = LocalControlPlane(
        tenants.deployments,
        tenants,
        LocalOptions(
            log_dir=tmp_path / "logs",
            port=free_port(),
            engine_command=lambda spec, host, p: [sys.executable, str(fake_engine), str(p), "0.2"],
        ),
        capacity=LocalCapacity(machine=lambda: MachineResources(cores=1)),
    )
    await plane.start()
    try:
        await plane.wait_warm(20)
        sup = plane.supervisors["tiny"]
        headers = {"Authorization": f"Bearer {tenants.demo_key}"}
        body = {"model": "tiny-model", "messages": [{"role": "user", "content": "x"}]}
        sizes: list[int] = []

        async def watch() -> None:
            while True:
                sizes.append(len(sup.replicas))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        codes: list[int] = []
        async with httpx.AsyncClient(base_url=plane.base_url, timeout=30) as client:
            for _ in range(5):  # waves of load until the policy has wanted more than fits
                calls = [
                    client.post(
                        "/chat/completions", json={**body, "max_tokens": 40}, headers=headers
                    )
                    for _ in range(12)
                ]
                codes += [r.status_code for r in await asyncio.gather(*calls)]
                decisions = plane.metrics.render().decode()
                if 'reason="no_capacity"' in decisions:
                    break
        watcher.cancel()
        assert 200 in codes
        assert max(sizes) == 1
        assert (
            'servefleet_autoscaler_decisions_total{deployment="tiny",reason="no_capacity"}'
            in decisions
        )
    finally:
        await plane.stop()
