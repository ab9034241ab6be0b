"""What became of a request is one `Outcome` (`servefleet.api.outcomes`): admission places a
request for one, the pool's answers carry theirs, `request_outcome` decides the final one, and
the gateway's metrics and access log are keyed by the same values."""

from __future__ import annotations

import pytest

from servefleet.api.access_log import AccessLogLine
from servefleet.api.outcomes import (
    BURNS_ERROR_BUDGET,
    PLACEMENTS,
    TENANTS_OWN,
    Outcome,
    request_outcome,
)
from servefleet.gateway.admission import PoolView, SpillRule, decide
from servefleet.gateway.metrics import GatewayMetrics
from servefleet.gateway.pool_types import Lease, Shed, Spill

OK, SPILLED, SHED = Outcome.OK, Outcome.SPILLED, Outcome.SHED


@pytest.mark.parametrize(
    "placed,status,completed,left,expected",
    [
        (OK, 200, True, False, Outcome.OK),
        (SPILLED, 200, True, False, Outcome.SPILLED),
        (SHED, 503, False, False, Outcome.SHED),
        (OK, 503, False, False, Outcome.SHED),  # every replica busy or draining
        (None, 429, False, False, Outcome.LIMITED),
        (OK, 429, False, False, Outcome.REJECTED),  # the engine's own 429: the request's
        (None, 400, False, False, Outcome.REJECTED),  # too large for the tenant's limits
        (SPILLED, 404, False, False, Outcome.REJECTED),
        (OK, 502, False, False, Outcome.UPSTREAM_ERROR),
        (OK, 200, False, False, Outcome.UPSTREAM_ERROR),  # a stream cut short
        (OK, 200, False, True, Outcome.CLIENT_CLOSED),  # the client left mid-stream
        (OK, None, False, False, Outcome.CLIENT_CLOSED),  # left before any answer
        (SHED, None, False, False, Outcome.CLIENT_CLOSED),
    ],
)
def test_one_function_from_a_placement_to_an_outcome(
    placed: Outcome | None, status: int | None, completed: bool, left: bool, expected: Outcome
) -> None:
    assert request_outcome(placed, status, completed=completed, client_left=left) is expected


def test_only_a_placement_is_placed() -> None:
    with pytest.raises(ValueError, match="placed"):
        request_outcome(Outcome.LIMITED, 429, completed=False)


def test_the_classes_of_outcomes_are_apart() -> None:
    assert not BURNS_ERROR_BUDGET & TENANTS_OWN
    assert {Lease.outcome, Spill.outcome, Shed.outcome} == PLACEMENTS


def _view(**changes: object) -> PoolView:
    fields: dict[str, object] = {
        "ready_replicas": 1,
        "free_slots": 0,
        "queue_ahead": 0,
        "queue_full": False,
        "service_rate": 1.0,
        "per_replica_rate": 1.0,
        "seconds_until_ready": None,
    }
    return PoolView(**{**fields, **changes})  # type: ignore[arg-type]


def test_admission_places_a_request_for_an_outcome() -> None:
    closed = SpillRule(allowed=False)
    served = decide(_view(free_slots=1), 30.0, closed)
    assert (served.placed, served.now) == (Outcome.OK, True)
    queued = decide(_view(), 30.0, closed)
    assert (queued.placed, queued.now) == (Outcome.OK, False)
    assert decide(_view(queue_full=True), 30.0, closed).placed is Outcome.SHED
    assert (
        decide(
            _view(ready_replicas=0, seconds_until_ready=60.0), 30.0, SpillRule(allowed=True)
        ).placed
        is SPILLED
    )
    assert decide(_view(queue_ahead=100), 30.0, closed).placed is Outcome.SHED


def test_every_outcome_has_its_counter_from_the_start() -> None:
    children = GatewayMetrics().for_tenant("t", "m").outcome
    assert set(children) == set(Outcome)


@pytest.mark.parametrize(
    "earlier,status,ours",
    [
        ("served", 200, Outcome.OK),
        ("spilled", 200, Outcome.SPILLED),
        ("shed", 503, Outcome.SHED),
        ("limited", 429, Outcome.LIMITED),
        ("failed", 499, Outcome.CLIENT_CLOSED),
        ("failed", 400, Outcome.REJECTED),
        ("failed", 502, Outcome.UPSTREAM_ERROR),
        ("failed", 200, Outcome.UPSTREAM_ERROR),
    ],
)
def test_an_access_log_in_the_earlier_words_still_replays(
    earlier: str, status: int, ours: Outcome
) -> None:
    line = AccessLogLine.model_validate_json(
        f'{{"ts": 1, "deployment": "d", "outcome": "{earlier}", "status": {status}}}'
    )
    assert line.outcome is ours
    assert line.offered_to_pool is (ours is not Outcome.LIMITED)


def test_the_access_log_writes_the_metric_label() -> None:
    line = AccessLogLine(ts=1, deployment="d", outcome=Outcome.SHED, status=503)
    assert '"outcome":"503"' in line.model_dump_json()
    with pytest.raises(ValueError, match="outcome"):
        AccessLogLine.model_validate({"ts": 1, "deployment": "d", "outcome": "vanished"})
