"""How many more engine replicas this machine can hold: local mode's `free_capacity`.

On Kubernetes a replica that does not fit stays Pending; on one machine it would start and
compete for the same cores, so latency caused by a busy CPU would buy replicas that make it
worse. Local mode therefore tells the policy how many more engines fit: cores left after the
engines already running (every deployment's, each counted at its CPU request, 1 core if
unset) and available memory over what one engine needs (the largest measured resident size of
a ready one, else its memory request). Engines still loading have not taken their memory yet,
so theirs is reserved.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from servefleet.api.engine_resources import engine_resources
from servefleet.api.llmdeployment import LLMDeploymentSpec
from servefleet.autoscaler.signals import ReplicaState

from .supervisor import DeploymentSupervisor

DEFAULT_ENGINE_CORES = 1.0
"""Cores an engine counts for without a CPU request: two engines on one core only share it."""


class MachineResources(BaseModel):
    """What this machine offers engines right now."""

    model_config = ConfigDict(frozen=True)

    cores: float = Field(gt=0, description="cores this process may run on (affinity, cgroup)")
    memory_available_bytes: int | None = Field(
        default=None, ge=0, description="memory that can be had without swapping; None unknown"
    )


class EngineFootprint(BaseModel):
    """What one engine replica of a deployment takes."""

    model_config = ConfigDict(frozen=True)

    cores: float = Field(gt=0)
    memory_bytes: int | None = Field(default=None, gt=0, description="None = not limiting")


def footprint_from_spec(spec: LLMDeploymentSpec) -> EngineFootprint:
    """The spec's requests (limits if no request), 1 core and unknown memory when unset."""
    resources = engine_resources(spec)
    return EngineFootprint(
        cores=resources.cores or DEFAULT_ENGINE_CORES, memory_bytes=resources.memory_bytes
    )


def read_machine() -> MachineResources:
    """Usable cores (affinity, capped by a cgroup v2 quota) and MemAvailable (capped by a
    cgroup v2 memory limit), from /proc and /sys; memory unknown where they are missing."""
    cores = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    quota = _read_words(Path("/sys/fs/cgroup/cpu.max"))
    if quota and quota[0] != "max" and len(quota) == 2:
        cores = min(cores, int(quota[0]) / int(quota[1]))
    available = _meminfo_available()
    limit, used = (
        _read_words(Path("/sys/fs/cgroup/memory.max")),
        _read_words(Path("/sys/fs/cgroup/memory.current")),
    )
    if limit and limit[0] != "max" and used:
        in_cgroup = max(0, int(limit[0]) - int(used[0]))
        available = in_cgroup if available is None else min(available, in_cgroup)
    return MachineResources(cores=max(cores, 0.01), memory_available_bytes=available)


def resident_bytes(pid: int) -> int | None:
    """A process's resident memory (VmRSS), or None when it cannot be read."""
    for line in _read_lines(Path(f"/proc/{pid}/status")):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


class LocalCapacity:
    """Free replicas per deployment, from the machine and every supervisor's engines."""

    def __init__(
        self,
        machine: Callable[[], MachineResources] = read_machine,
        resident: Callable[[int], int | None] = resident_bytes,
    ) -> None:
        self._machine = machine
        self._resident = resident
        self._deployments: dict[str, tuple[EngineFootprint, DeploymentSupervisor]] = {}

    def add(self, name: str, spec: LLMDeploymentSpec, supervisor: DeploymentSupervisor) -> None:
        self._deployments[name] = (footprint_from_spec(spec), supervisor)

    def free_replicas(self, name: str) -> int:
        """More engines of `name` that fit now (0 when none does)."""
        footprint, _ = self._deployments[name]
        machine = self._machine()
        used_cores = sum(fp.cores * len(sup.live()) for fp, sup in self._deployments.values())
        by_cores = math.floor((machine.cores - used_cores) / footprint.cores + 1e-9)
        per_engine = self.engine_memory(name)
        if per_engine is None or machine.memory_available_bytes is None:
            return max(0, by_cores)
        loading = sum(
            (self.engine_memory(other) or 0) * _count(sup, ReplicaState.STARTING)
            for other, (_, sup) in self._deployments.items()
        )
        by_memory = (machine.memory_available_bytes - loading) // per_engine
        return max(0, min(by_cores, by_memory))

    def engine_memory(self, name: str) -> int | None:
        """Bytes one engine of `name` needs: the largest ready one measured, else the spec."""
        footprint, supervisor = self._deployments[name]
        measured = [
            self._resident(r.process.pid)
            for r in supervisor.live()
            if r.state is ReplicaState.READY and not r.exited
        ]
        return max((m for m in measured if m), default=footprint.memory_bytes)


def _count(supervisor: DeploymentSupervisor, state: ReplicaState) -> int:
    return sum(1 for r in supervisor.live() if r.state is state)


def _meminfo_available() -> int | None:
    for line in _read_lines(Path("/proc/meminfo")):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _read_words(path: Path) -> list[str]:
    lines = _read_lines(path)
    return lines[0].split() if lines else []
