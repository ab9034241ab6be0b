"""The replica's process group: join it, reduce partial sums, gather logits, broadcast plans.

WORLD_SIZE = TP × PP ranks laid out as vLLM lays them: rank = stage · TP + tp_rank, so a
stage's tensor shards are consecutive ranks. Plans are broadcast over the whole group;
all-reduces and the logits' gather run in the stage's own tensor group (`dist.new_group`,
one per stage; the whole group itself when there is one stage). gloo on CPU, NCCL on CUDA
(chosen by the engine's device). Every collective is bounded by
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
    tensor_size: int = 0  # TP: ranks per stage (0: every rank, i.e. one stage)
    tensor_group: dist.ProcessGroup | None = None  # this stage's (None: the whole group)
    stats: CommStats = field(default_factory=CommStats)
    micro_batch_parts: int = 1  # --pipeline-micro-batches: cut a step into up to this many
    micro_batches_run: int = 0  # micro-batches of cut steps run (`stages`), for tests

    def __post_init__(self) -> None:
        self.tensor_size = self.tensor_size or self.world_size

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def stages(self) -> int:
        """PP: pipeline stages."""
        return self.world_size // self.tensor_size

    @property
    def stage(self) -> int:
        return self.rank // self.tensor_size

    @property
    def tensor_rank(self) -> int:
        """This rank's shard within its stage (its heads, MLP columns, vocabulary rows)."""
        return self.rank % self.tensor_size

    @property
    def pipeline(self) -> bool:
        return self.stages > 1

    @property
    def stage_leader(self) -> int:
        """The global rank of this stage's tensor rank 0 (where its logits are gathered)."""
        return self.stage * self.tensor_size

    def _run(self, what: str, call: Callable[[], object], tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        try:
            call()
        except (RuntimeError, ValueError) as exc:  # gloo and NCCL raise RuntimeError subclasses
            raise GroupLostError(f"rank {self.rank}: {what} failed: {exc}") from exc
        self.stats.add(started, tensor)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over this stage's tensor ranks, in place (the row-parallel projections' partials)."""
        self._run("all_reduce", lambda: dist.all_reduce(tensor, group=self.tensor_group), tensor)
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

    def send_later(self, tensor: torch.Tensor, peer: int) -> Callable[[], None]:
        """Start sending `tensor` to rank `peer`; the returned call waits for it (so a
        stage runs its next micro-batch while the next stage receives this one)."""
        started = time.perf_counter()
        try:
            work = dist.isend(tensor, peer)
        except (RuntimeError, ValueError) as exc:
            raise GroupLostError(f"rank {self.rank}: send to {peer} failed: {exc}") from exc

        def wait() -> None:
            self._run(f"send to {peer}", lambda: work is None or work.wait(), tensor)

        self.stats.seconds += time.perf_counter() - started
        return wait

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks: every rank holds as many)."""
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        self._run("all_reduce", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MIN), tensor)
        return int(tensor.item())

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The stage's [N, V/TP] slices side by side ([N, V]) on its tensor rank 0; None
        elsewhere."""
        tensor = tensor.contiguous()
        leader = self.tensor_rank == 0
        parts = [torch.empty_like(tensor) for _ in range(self.tensor_size)] if leader else None
        self._run(
            "gather",
            lambda: dist.gather(tensor, parts, dst=self.stage_leader, group=self.tensor_group),
            tensor,
        )
        return torch.cat(parts, dim=-1) if parts is not None else None


def join_group(
    place: RankPlace, device: torch.device, timeout_s: float, tensor_size: int = 0
) -> ParallelGroup:
    """Rendezvous at MASTER_ADDR:MASTER_PORT (rank 0 listens there) and return the group,
    `tensor_size` consecutive ranks a stage (0: every rank in one stage)."""
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
        group = ParallelGroup(place.rank, place.world_size, device, tensor_size)
        group.tensor_group = _stage_groups(group, timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, OSError) as exc:
        where = f"{place.master_addr}:{place.master_port}"
        raise GroupLostError(f"rank {place.rank}: rendezvous at {where} failed: {exc}") from exc
    log.info(
        "parallel_group_joined: rank=%d world_size=%d tensor=%d stages=%d backend=%s "
        "master=%s:%d join_s=%.2f",
        place.rank,
        place.world_size,
        group.tensor_size,
        group.stages,
        backend,
        place.master_addr,
        place.master_port,
        time.monotonic() - started,
    )
    return group


def _stage_groups(group: ParallelGroup, timeout: timedelta) -> dist.ProcessGroup | None:
    """This stage's tensor group. Every rank creates every stage's (`new_group` is
    collective over the whole group, in the same order everywhere); one stage needs none."""
    if group.stages == 1 or group.tensor_size == 1:
        return None
    size = group.tensor_size
    made = [
        dist.new_group(list(range(s * size, (s + 1) * size)), timeout=timeout)
        for s in range(group.stages)
    ]
    mine = made[group.stage]
    assert isinstance(mine, dist.ProcessGroup)  # the others' are placeholders here
    return mine


def leave_group() -> None:
    """Tear the group down (best effort: a lost group may not tear down cleanly)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError) as exc:
            log.debug("destroy_process_group: %r", exc)
