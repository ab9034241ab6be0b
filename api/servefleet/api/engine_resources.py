"""What one engine replica takes, read once from the spec: the one place that maps spec fields
onto resources, for every engine kind and both ways of running it.

The operator's engine pod (the container's requests and limits, the GPU toleration, a
memory-backed `/dev/shm` for the kinds that need one) and local mode's count of how many more
engines fit on the machine (cores, memory) read an `EngineResources`, so a new spec field that
changes what a replica takes is mapped in `engine_resources` and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servefleet.api.conventions import SHM_MOUNT, SHM_VOLUME
from servefleet.api.disaggregation import Role
from servefleet.api.engines import engine_adapter
from servefleet.api.llmdeployment import LLMDeploymentSpec
from servefleet.api.quantity import parse_memory_size


def parse_cpu(quantity: int | str) -> float:
    """A Kubernetes CPU quantity in cores: 2, "1.5", "500m"."""
    text = str(quantity).strip()
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


@dataclass(frozen=True)
class EngineResources:
    """One replica's resources: Kubernetes quantities as the spec gave them."""

    requests: dict[str, int | str] = field(default_factory=dict)
    limits: dict[str, int | str] = field(default_factory=dict)
    gpus: int = 0
    shared_memory: bool = False
    """A memory-backed `/dev/shm` (vLLM and SGLang: NCCL and their worker processes)."""

    def container(self) -> dict[str, Any]:
        """The container's `resources`, as the Pod API spells them (empty: nothing asked)."""
        out: dict[str, Any] = {}
        if self.requests:
            out["requests"] = {k: str(v) for k, v in sorted(self.requests.items())}
        if self.limits:
            out["limits"] = {k: str(v) for k, v in sorted(self.limits.items())}
        return out

    def volumes(self) -> list[dict[str, Any]]:
        return (
            [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}] if self.shared_memory else []
        )

    def mounts(self) -> list[dict[str, Any]]:
        return [{"name": SHM_VOLUME, "mountPath": SHM_MOUNT}] if self.shared_memory else []

    def _request(self, name: str) -> int | str | None:
        """A request, else its limit (a limit alone is what Kubernetes requests too)."""
        return self.requests.get(name, self.limits.get(name))

    @property
    def cores(self) -> float | None:
        """CPU cores asked for; None when unset (or zero)."""
        cpu = self._request("cpu")
        return parse_cpu(cpu) if cpu is not None and parse_cpu(cpu) > 0 else None

    @property
    def memory_bytes(self) -> int | None:
        memory = self._request("memory")
        return parse_memory_size(memory).bytes if memory is not None else None


def engine_resources(spec: LLMDeploymentSpec, role: Role | None = None) -> EngineResources:
    """What a replica of `spec` takes (`role` prefill: `disaggregation.prefill.resources`
    when set)."""
    engine = spec.engine
    res = engine.resources
    block = spec.disaggregation
    if role == "prefill" and block is not None and block.prefill.resources is not None:
        res = block.prefill.resources
    return EngineResources(
        requests=dict(res.requests),
        limits=dict(res.limits),
        gpus=res.gpus(),
        shared_memory=engine_adapter(engine.kind).needs_shared_memory,
    )
