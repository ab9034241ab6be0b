"""The replica's process group: join it, reduce partial sums, gather logits, broadcast plans.

gloo on CPU, NCCL on CUDA (chosen by the engine's device). Every collective is bounded by
`--dist-timeout`; a peer that dies closes its sockets, so the others' collectives fail at
once rather than at the timeout. A failure raises `GroupLostError`, which the caller turns
into one log line and a non-zero exit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from servefleet.api.rank_place import RankPlace

log = logging.getLogger("servefleet.engine.parallel")


class GroupLostError(RuntimeError):
    """A collective failed or timed out: a peer rank died or hangs; the replica is lost."""


@dataclass
class CommStats:
    """Time and bytes spent in collectives (this rank's view), for the bench and logs."""

    seconds: float = 0.0
    bytes: int = 0
    calls: int = 0

    def add(self, started: float, tensor: torch.Tensor) -> None:
        self.seconds += time.perf_counter() - started
        self.bytes += tensor.numel() * tensor.element_size()
        self.calls += 1


@dataclass
class ParallelGroup:
    """This process's place in the replica's group and the collectives the model needs."""

    rank: int
    world_size: int
    device: torch.device
    pipeline: bool = False  # the ranks are pipeline stages, not tensor shards
    stats: CommStats = field(default_factory=CommStats)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def _run(self, what: str, call: Callable[[], object], tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        try:
            call()
        except (RuntimeError, ValueError) as exc:  # gloo and NCCL raise RuntimeError subclasses
            raise GroupLostError(f"rank {self.rank}: {what} failed: {exc}") from exc
        self.stats.add(started, tensor)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `tensor`, in place (the row-parallel projections' partials)."""
        self._run("all_reduce", lambda: dist.all_reduce(tensor), tensor)
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU `tensor` into every rank's (same shape and dtype everywhere)."""
        moved = tensor.to(self.device)  # NCCL moves device tensors only
        self._run("broadcast", lambda: dist.broadcast(moved, src=0), moved)
        if moved is not tensor:
            tensor.copy_(moved)
        return tensor

    def point_to_point(self, direction: str, tensor: torch.Tensor, peer: int) -> torch.Tensor:
        """Send `tensor` to rank `peer`, or receive into it from `peer` (pipeline stages)."""
        if direction == "send":
            self._run(f"send to {peer}", lambda: dist.send(tensor, peer), tensor)
        else:
            self._run(f"recv from {peer}", lambda: dist.recv(tensor, peer), tensor)
        return tensor

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks: every rank holds as many)."""
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        self._run("all_reduce", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MIN), tensor)
        return int(tensor.item())

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's [N, V/world] slice side by side on rank 0 ([N, V]); None elsewhere."""
        tensor = tensor.contiguous()
        parts = (
            [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == 0 else None
        )
        self._run("gather", lambda: dist.gather(tensor, parts, dst=0), tensor)
        return torch.cat(parts, dim=-1) if parts is not None else None


def join_group(
    place: RankPlace, device: torch.device, timeout_s: float, pipeline: bool = False
) -> ParallelGroup:
    """Rendezvous at MASTER_ADDR:MASTER_PORT (rank 0 listens there) and return the group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    started = time.monotonic()
    try:  # the rendezvous waits up to the timeout for every rank to arrive
        dist.init_process_group(
            backend,
            init_method=f"tcp://{place.master_addr}:{place.master_port}",
            rank=place.rank,
            world_size=place.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except (RuntimeError, ValueError, OSError) as exc:
        where = f"{place.master_addr}:{place.master_port}"
        raise GroupLostError(f"rank {place.rank}: rendezvous at {where} failed: {exc}") from exc
    log.info(
        "parallel_group_joined: rank=%d world_size=%d backend=%s master=%s:%d join_s=%.2f",
        place.rank,
        place.world_size,
        backend,
        place.master_addr,
        place.master_port,
        time.monotonic() - started,
    )
    return ParallelGroup(place.rank, place.world_size, device, pipeline)


def leave_group() -> None:
    """Tear the group down (best effort: a lost group may not tear down cleanly)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError) as exc:
            log.debug("destroy_process_group: %r", exc)
