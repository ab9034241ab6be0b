"""Open batches' demand on a deployment, as gateway replicas report it and the autoscaler
merges it (the Batch API's deadline signal).

An open batch leaves some lines per model, due by its `expires_at`. Run earliest deadline
first on one shared pool, every batch is answered in time exactly when, for each deadline d,
the lines due by d fit in the time left: the pool must sustain the largest (lines due by d) /
(d - now) lines per second (EDF feasibility).

Gateway replicas over one shared store (a bucket) each see every open batch, so their reports
overlap: each reports every batch it knows by id, and the merge keeps one figure per batch,
the report of the replica running it (it journals each line as it ends) else the smallest
(the freshest of stale views). Replicas with stores of their own report disjoint batches.
Pydantic only.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

Due = tuple[int, float]  # (lines, deadline)


class BatchDue(BaseModel):
    """One open batch's lines for one deployment, not answered yet."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    batch_id: str
    lines: int = Field(ge=0)
    expires_at: float = Field(description="the batch's deadline, wall clock (Unix seconds)")
    running: bool = Field(
        default=False, description="this gateway replica runs it (holds its lease): current"
    )


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


def merge_batch_due(reports: Iterable[Iterable[BatchDue]]) -> list[BatchDue]:
    """One figure per batch over every replica's report: the running replica's, else the
    fewest lines left (a replica's view of a batch another runs is as old as its last read)."""
    merged: dict[str, BatchDue] = {}
    for report in reports:
        for due in report:
            seen = merged.get(due.batch_id)
            if seen is None or (due.running, -due.lines) > (seen.running, -seen.lines):
                merged[due.batch_id] = due
    return sorted(merged.values(), key=lambda d: (d.expires_at, d.batch_id))
