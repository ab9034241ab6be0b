"""The per-deployment queue: bounded, interactive before batch, weighted fair across tenants.

Inside a traffic class, tenants share the pool by start-time fair queuing (SFQ): each request
gets a start tag `max(virtual time, tenant's last finish)` and a finish tag `start + cost /
weight`; the smallest start tag goes next and the virtual time follows the start tags served.
A tenant that floods the queue only pushes its *own* tags into the future, so a light
tenant's request is served after roughly its fair share of work, not after the whole flood.
A tenant returning from idle may start up to `burst_credit` requests behind the virtual time
(bounded lag): a light tenant's burst is served at the pool's pace instead of at half of it,
while anyone continuously backlogged is bound by its own finish tags, so shares do not move.
Each tenant's tags grow monotonically, so a tenant's backlog is a FIFO and the position of a
new request is a binary search per backlogged tenant.

When the queue is full an arriving request may push out a queued one instead of being refused:
batch is pushed out before interactive, and within a class the victim is the newest request of
the tenant with the most requests queued, if that tenant has more queued than the newcomer's.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


class TrafficClass(IntEnum):
    INTERACTIVE = 0
    BATCH = 1

    @classmethod
    def parse(cls, value: str) -> TrafficClass:
        return cls.BATCH if value.lower() == "batch" else cls.INTERACTIVE


@dataclass(slots=True, eq=False)
class QueuedRequest:
    tenant: str
    traffic_class: TrafficClass
    start_tag: float
    finish_tag: float
    seq: int
    enqueued_at: float
    future: asyncio.Future[Any] | None = None
    payload: Any = None  # what the dispatcher needs to route it (e.g. the affinity key)
    cancelled: bool = False


@dataclass(slots=True)
class _Lane:
    """One traffic class: a FIFO per tenant and the class' virtual time."""

    backlogs: dict[str, deque[QueuedRequest]] = field(default_factory=dict)
    last_finish: dict[str, float] = field(default_factory=dict)
    virtual_time: float = 0.0
    live: int = 0


class QueueFull(Exception):
    """No room, and nothing queued may be pushed out for this request."""


class FairQueue:
    def __init__(self, max_depth: int, *, burst_credit: float = 8.0) -> None:
        if max_depth < 0:
            raise ValueError("max_depth must be >= 0")
        if burst_credit < 0:
            raise ValueError("burst_credit must be >= 0")
        self.max_depth = max_depth
        self.burst_credit = burst_credit
        self._lanes = (_Lane(), _Lane())
        self._seq = itertools.count()

    # -- sizes --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._lanes[0].live + self._lanes[1].live

    def depth(self, traffic_class: TrafficClass) -> int:
        return self._lanes[traffic_class].live

    @property
    def full(self) -> bool:
        return len(self) >= self.max_depth

    # -- tags ---------------------------------------------------------------------------
    def _tags(self, lane: _Lane, tenant: str, cost: float, weight: float) -> tuple[float, float]:
        # A tenant back from idle starts up to `burst_credit` requests behind virtual time, so
        # a short burst from a light tenant is not interleaved 1:1 with a flood; a backlogged
        # tenant's own last finish tag dominates, so long-run shares are unchanged.
        floor = lane.virtual_time - self.burst_credit * cost
        start = max(floor, lane.last_finish.get(tenant, floor))
        return start, start + cost / weight

    def ahead_of(
        self, tenant: str, traffic_class: TrafficClass, cost: float, weight: float = 1.0
    ) -> int:
        """How many queued requests would be dispatched before one pushed now."""
        ahead = sum(lane.live for lane in self._lanes[:traffic_class])
        lane = self._lanes[traffic_class]
        _, finish = self._tags(lane, tenant, cost, weight)
        for backlog in lane.backlogs.values():
            if backlog:
                ahead += bisect.bisect_right(backlog, finish, key=_finish_tag)
        return ahead

    # -- push / pop ---------------------------------------------------------------------
    def push(
        self,
        tenant: str,
        traffic_class: TrafficClass,
        cost: float,
        now: float,
        *,
        weight: float = 1.0,
        future: asyncio.Future[Any] | None = None,
        payload: Any = None,
        promised: bool = False,
    ) -> QueuedRequest:
        """Queue a request; raises QueueFull when there is no room (see `make_room`), unless it
        was promised a place (a retry back at its Retry-After: see retry_promises)."""
        if self.full and not promised:
            raise QueueFull()
        lane = self._lanes[traffic_class]
        start, finish = self._tags(lane, tenant, max(cost, 1e-9), max(weight, 1e-9))
        lane.last_finish[tenant] = finish
        entry = QueuedRequest(
            tenant, traffic_class, start, finish, next(self._seq), now, future, payload
        )
        backlog = lane.backlogs.get(tenant)
        if backlog is None:
            backlog = lane.backlogs[tenant] = deque()
        backlog.append(entry)
        lane.live += 1
        return entry

    def pop(self, upto: TrafficClass = TrafficClass.BATCH) -> QueuedRequest | None:
        """The next request to dispatch: interactive first, then the smallest finish tag;
        only from classes up to `upto` (interactive only: the free slots are kept for it)."""
        for lane in self._lanes[: upto + 1]:
            if lane.live == 0:
                continue
            best: QueuedRequest | None = None
            best_rank: tuple[float, int, int] = (0.0, 0, 0)
            for backlog in lane.backlogs.values():
                while backlog and backlog[0].cancelled:
                    backlog.popleft()
                if not backlog:
                    continue
                head = backlog[0]
                # Smallest start tag first; on a tie the tenant with less queued goes first.
                rank = (head.start_tag, len(backlog), head.seq)
                if best is None or rank < best_rank:
                    best, best_rank = head, rank
            if best is None:
                lane.live = 0
                continue
            lane.backlogs[best.tenant].popleft()
            lane.live -= 1
            lane.virtual_time = max(lane.virtual_time, best.start_tag)
            self._forget_idle(lane)
            return best
        return None

    def cancel(self, entry: QueuedRequest) -> None:
        """Drop a request that gave up (timed out, client left); lazily removed on pop."""
        if entry.cancelled:
            return
        entry.cancelled = True
        lane = self._lanes[entry.traffic_class]
        lane.live -= 1
        backlog = lane.backlogs.get(entry.tenant)
        if backlog and backlog[-1] is entry:
            backlog.pop()
            # Give the tenant its virtual time back so giving up does not cost it its share.
            lane.last_finish[entry.tenant] = backlog[-1].finish_tag if backlog else entry.start_tag

    def make_room(self, tenant: str, traffic_class: TrafficClass) -> QueuedRequest | None:
        """Pick a queued request to push out for a newcomer, or None if none may be.

        The caller cancels the victim (and answers it) before pushing the newcomer.
        """
        if not self.full:
            return None
        # Batch goes first when an interactive request needs room.
        if traffic_class is TrafficClass.INTERACTIVE and self._lanes[1].live:
            victim = self._newest_of_heaviest(self._lanes[1], exclude=None)
            if victim is not None:
                return victim
        lane = self._lanes[traffic_class]
        mine = sum(1 for r in lane.backlogs.get(tenant, ()) if not r.cancelled)
        victim = self._newest_of_heaviest(lane, exclude=tenant)
        if victim is None:
            return None
        theirs = sum(1 for r in lane.backlogs[victim.tenant] if not r.cancelled)
        return victim if theirs > mine + 1 else None

    @staticmethod
    def _newest_of_heaviest(lane: _Lane, exclude: str | None) -> QueuedRequest | None:
        heaviest: deque[QueuedRequest] | None = None
        size = 0
        for tenant, backlog in lane.backlogs.items():
            if tenant == exclude:
                continue
            live = sum(1 for r in backlog if not r.cancelled)
            if live > size:
                heaviest, size = backlog, live
        if heaviest is None:
            return None
        for entry in reversed(heaviest):
            if not entry.cancelled:
                return entry
        return None

    @staticmethod
    def _forget_idle(lane: _Lane) -> None:
        # An idle tenant whose last tag is behind virtual time has no state worth keeping.
        if len(lane.last_finish) > 1024:
            for tenant in [t for t, f in lane.last_finish.items() if f <= lane.virtual_time]:
                if not lane.backlogs.get(tenant):
                    del lane.last_finish[tenant]
                    lane.backlogs.pop(tenant, None)


def _finish_tag(entry: QueuedRequest) -> float:
    return entry.finish_tag
