"""Admission control: one decision per request, before dispatch.

The gateway predicts how long a request would wait — the work queued ahead of it in its class,
divided by the pool's measured service rate, plus, when no replica is ready, the time until one
will be (from the measured cold start) — and decides once: serve now, queue, spill over to the
hosted API, or shed with a `Retry-After` equal to that prediction. A request is never queued to
be answered after the deployment's maximum wait. The decision is the outcome the request is
placed for (`servefleet.api.outcomes`): `OK` (a replica: now when the predicted wait is 0, else
after queueing), `SPILLED` or `SHED`.
"""

from __future__ import annotations

from dataclasses import dataclass

from servefleet.api.outcomes import Outcome


@dataclass(frozen=True, slots=True)
class PoolView:
    """What admission needs to know about a deployment's pool right now."""

    ready_replicas: int
    free_slots: int
    queue_ahead: int  # requests that would be dispatched before this one
    queue_full: bool  # no room, even after pushing out a lower-priority request
    service_rate: float  # requests per second the ready replicas complete
    per_replica_rate: float  # requests per second one replica completes
    seconds_until_ready: float | None  # None: a replica is ready now


@dataclass(frozen=True, slots=True)
class SpillRule:
    """When a deployment's tenant may be sent to the hosted API instead."""

    allowed: bool  # spill-over configured, this tenant may spill, and the rate cap has room
    on_queue_full: bool = True
    on_no_ready_replica: bool = True
    wait_over_s: float | None = None


@dataclass(frozen=True, slots=True)
class Admission:
    placed: Outcome  # one of `outcomes.PLACEMENTS`
    predicted_wait_s: float
    reason: str

    @property
    def now(self) -> bool:
        """Served at once: a slot is free (else it queues for one, or is spilled or shed)."""
        return self.placed is Outcome.OK and self.predicted_wait_s == 0.0


def predict_wait(view: PoolView) -> float:
    """Seconds until a slot frees for a request arriving now (0 when one is free)."""
    if view.ready_replicas > 0:
        if view.free_slots > 0 and view.queue_ahead == 0:
            return 0.0
        rate = max(view.service_rate, 1e-6)
        # Slots are busy: it waits for the requests ahead of it plus one completion.
        return (view.queue_ahead + 1) / rate
    until_ready = view.seconds_until_ready or 0.0
    rate = max(view.per_replica_rate, 1e-6)
    return until_ready + view.queue_ahead / rate


def decide(view: PoolView, max_queue_wait_s: float, spill: SpillRule) -> Admission:
    wait = predict_wait(view)
    if wait == 0.0:
        return Admission(Outcome.OK, 0.0, "slot free")
    no_replica = view.ready_replicas == 0
    if spill.allowed:
        if spill.on_no_ready_replica and no_replica:
            return Admission(Outcome.SPILLED, wait, "no ready replica")
        if spill.on_queue_full and view.queue_full:
            return Admission(Outcome.SPILLED, wait, "queue full")
        if spill.wait_over_s is not None and wait > spill.wait_over_s:
            return Admission(Outcome.SPILLED, wait, "predicted wait over spill threshold")
    if view.queue_full:
        return Admission(Outcome.SHED, wait, "queue full")
    if wait > max_queue_wait_s:
        return Admission(Outcome.SHED, wait, "predicted wait over maxQueueWait")
    return Admission(Outcome.OK, wait, "waiting for a slot")
