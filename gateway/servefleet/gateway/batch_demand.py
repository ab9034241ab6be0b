"""What open batches still ask of each deployment: the autoscaler's batch signal.

An open batch leaves some lines per model, due by its `expires_at`. Run earliest deadline first
(the runner's order) on one shared pool, every batch is answered in time exactly when, for each
deadline d, the lines due by d fit in the time left: the pool must sustain the largest (lines
due by d) / (d - now) lines per second (EDF feasibility). Each deployment's pool reports that
rate and its lines left (`DeploymentStats.batch_*`); the autoscaler turns the rate into replicas
with the measured seconds a request holds a slot, so it buys them only when the pool it has
would miss a deadline.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

Due = tuple[int, float]  # (lines, deadline)


@dataclass(slots=True)
class OpenWork:
    """One open batch's lines not answered yet, per model."""

    tenant: str
    expires_at: float  # wall clock, seconds (the batch's own field)
    left: Counter[str] = field(default_factory=Counter)


def lines_per_second_needed(due: Iterable[Due], now: float) -> float:
    """The line rate that meets every deadline, earliest first. A deadline already past is
    left out: that batch expires with its partial output, and no replica bought now helps."""
    rate, total = 0.0, 0
    for lines, deadline in sorted(due, key=lambda d: d[1]):
        if deadline <= now or lines <= 0:
            continue
        total += lines
        rate = max(rate, total / (deadline - now))
    return rate


def due_by_pool(
    works: Iterable[OpenWork],
    route_of: Callable[[str, str], tuple[str, float | None] | None],
    wall_now: float,
) -> dict[str, list[Due]]:
    """(lines, wall-clock deadline) per deployment. `route_of(tenant, model)` names the
    deployment a tenant's model is served by and the tenant's request rate cap there (None:
    no route, the lines will fail). A tenant is counted for no more lines than its own rate
    limit lets it send before the deadline: a batch cannot make the pool buy replicas its
    owner may not use."""
    due: dict[str, list[Due]] = {}
    for work in works:
        for model, lines in work.left.items():
            route = route_of(work.tenant, model)
            if route is None or lines <= 0:
                continue
            pool, per_second = route
            if per_second is not None:
                lines = min(lines, math.ceil(per_second * max(0.0, work.expires_at - wall_now)))
            due.setdefault(pool, []).append((lines, work.expires_at))
    return due
