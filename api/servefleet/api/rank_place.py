"""How one replica spread over several processes finds itself: names both sides read.

The pods (or local processes) of one multi-process replica are told their place through
torch's standard environment (`torchrun`'s names), so the same engine command runs under
a LeaderWorkerSet, `torchrun` or by hand: rank 0 serves HTTP and schedules, the other
ranks only run the model. Flags: `--tensor-parallel-size`, `--pipeline-parallel-size`,
`--dist-timeout` (`servefleet.api.engine_flags`).

Standard library only (the CLI reads these before importing torch).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from servefleet.api.parallel import (  # the names LeaderWorkerSet pods are rendered with
    MASTER_ADDR_ENV,
    MASTER_PORT_ENV,
    RANK_ENV,
    RENDEZVOUS_PORT,
    WORLD_SIZE_ENV,
)

LOCAL_RANK_ENV = "LOCAL_RANK"
"""Rank among the processes of one machine: picks `cuda:LOCAL_RANK` (default: RANK)."""
DEFAULT_DIST_TIMEOUT_S = 60.0
"""Longest one collective waits for a peer before the group is declared lost."""


@dataclass(frozen=True)
class RankPlace:
    """Where this process sits in its replica's group (from the environment)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def rank_place(env: Mapping[str, str] | None = None) -> RankPlace:
    """The place the environment gives (a lone process: rank 0 of 1); ValueError names the
    variable that is malformed or out of range."""
    env = os.environ if env is None else env

    def number(name: str, default: int) -> int:
        raw = env.get(name, "")
        try:
            return int(raw) if raw.strip() else default
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer") from None

    world = number(WORLD_SIZE_ENV, 1)
    rank = number(RANK_ENV, 0)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"{RANK_ENV}={rank} is outside {WORLD_SIZE_ENV}={world}")
    port = number(MASTER_PORT_ENV, RENDEZVOUS_PORT)
    if not 0 < port < 65536:
        raise ValueError(f"{MASTER_PORT_ENV}={port} is not a TCP port")
    return RankPlace(
        rank=rank,
        world_size=world,
        local_rank=number(LOCAL_RANK_ENV, rank),
        master_addr=env.get(MASTER_ADDR_ENV) or "127.0.0.1",
        master_port=port,
    )
