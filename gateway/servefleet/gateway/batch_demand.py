"""What open batches still ask of each deployment: the autoscaler's batch signal.

Each deployment's pool reports, per open batch, the lines left for it and the batch's deadline
(`DeploymentStats.batch_due`, `servefleet.api.batch_demand`), and the line rate that answers
them all earliest deadline first; the autoscaler merges the gateway replicas' reports (one
figure per batch) and turns the rate into replicas with the measured seconds a request holds a
slot, so it buys them only when the pool it has would miss a deadline.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from servefleet.api.batch_demand import BatchDue


@dataclass(slots=True)
class OpenWork:
    """One open batch's lines not answered yet, per model."""

    batch_id: str
    tenant: str
    expires_at: float  # wall clock, seconds (the batch's own field)
    left: Counter[str] = field(default_factory=Counter)
    running: bool = False  # this replica holds its lease


def due_by_pool(
    works: Iterable[OpenWork],
    route_of: Callable[[str, str], tuple[str, float | None] | None],
    wall_now: float,
) -> dict[str, list[BatchDue]]:
    """Each open batch's lines and wall-clock deadline, per deployment. `route_of(tenant,
    model)` names the deployment a tenant's model is served by and the tenant's request rate
    cap there (None: no route, the lines will fail). A tenant is counted for no more lines
    than its own rate limit lets it send before the deadline: a batch cannot make the pool
    buy replicas its owner may not use."""
    works = list(works)
    lines_of: dict[str, Counter[str]] = {}
    for work in works:
        for model, lines in work.left.items():
            route = route_of(work.tenant, model)
            if route is None or lines <= 0:
                continue
            pool, per_second = route
            if per_second is not None:
                lines = min(lines, math.ceil(per_second * max(0.0, work.expires_at - wall_now)))
            lines_of.setdefault(pool, Counter())[work.batch_id] += lines
    works_by_id = {work.batch_id: work for work in works}
    return {
        pool: [
            BatchDue(
                batch_id=batch_id,
                lines=lines,
                expires_at=works_by_id[batch_id].expires_at,
                running=works_by_id[batch_id].running,
            )
            for batch_id, lines in counts.items()
        ]
        for pool, counts in lines_of.items()
    }
