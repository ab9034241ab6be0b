"""What the pool is asked and what it answers: a request to place; a lease on a replica, a
spill-over, or a shed with its Retry-After. Each answer is placed for one outcome of
`servefleet.api.outcomes` (its `outcome`), which is all the metrics and the access log read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from servefleet.api.outcomes import Outcome
from servefleet.gateway.queueing import TrafficClass
from servefleet.gateway.routing import Replica


@dataclass(frozen=True, slots=True)
class PoolRequest:
    """What the pool needs to know about a request to place it."""

    tenant: str
    traffic_class: TrafficClass
    weight: float
    tokens: int  # prompt + the completion budget: its cost in the queue and on a replica
    affinity_key: int | None
    retry_key: bytes | None = None  # tenant + body: known again when it comes back (retry_promises)
    adapter: str | None = None  # the LoRA adapter it asks for: its holders are preferred
    block_hashes: tuple[int, ...] = ()  # its prompt's KV blocks: routed by who holds them


@dataclass(slots=True, eq=False)
class Lease:
    """A slot on a replica, held from dispatch until the response ends."""

    outcome: ClassVar[Outcome] = Outcome.OK

    replica: Replica
    tokens: int
    dispatched_at: float
    queue_wait_s: float = 0.0
    released: bool = False
    batch: bool = False  # a batch request's slot: load, but not demand that buys replicas
    kv_source: str | None = None  # a replica likely to hold the prompt's prefix KV, not this one
    kv_deadline_s: float | None = None  # how long the pull may take (the cost model's), if set


@dataclass(frozen=True, slots=True)
class Spill:
    """Send the request to the hosted API; one unit of the spill-over budget is taken."""

    outcome: ClassVar[Outcome] = Outcome.SPILLED

    reason: str


@dataclass(frozen=True, slots=True)
class Shed:
    """Answer 503 with this Retry-After."""

    outcome: ClassVar[Outcome] = Outcome.SHED

    retry_after_s: float
    reason: str


Placement = Lease | Spill | Shed
"""What `DeploymentPool.acquire` answers."""
