"""Status and Events computed from the observed engine Deployment."""

from __future__ import annotations

from typing import Any

from servefleet.api.llmdeployment import LLMDeployment, LLMDeploymentStatus
from servefleet.operator.status import Observed, compute_status, status_patch, transition_events

NOW, LATER = "2025-01-01T00:00:00Z", "2025-01-01T00:05:00Z"


def dep(
    min_replicas: int = 2, replicas: int | None = None, status: LLMDeploymentStatus | None = None
) -> LLMDeployment:
    d = LLMDeployment.model_validate(
        {
            "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 4},
            "spec": {
                "model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}},
                "replicas": replicas,
                "pool": {"minReplicas": min_replicas, "maxReplicas": 5},
            },
        }
    )
    if status is not None:
        d.status = status
    return d


def deployment(
    replicas: int,
    ready: int,
    updated: int | None = None,
    current: bool = True,
    **conditions: dict[str, Any],
) -> dict[str, Any]:
    return {
        "metadata": {"generation": 3},
        "status": {
            "observedGeneration": 3 if current else 2,
            "replicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
            "conditions": [{"type": t, **c} for t, c in conditions.items()],
        },
    }


def cond(status: LLMDeploymentStatus, type_: str) -> tuple[str, str]:
    c = status.condition(type_)
    assert c is not None
    return c.status, c.reason


def test_before_the_deployment_exists() -> None:
    s = compute_status(dep(), Observed(None), "http://gw/v1", NOW)
    assert cond(s, "Ready") == ("False", "WarmPoolNotReady")
    assert cond(s, "Progressing") == ("True", "Creating")
    assert cond(s, "Degraded") == ("False", "AsExpected")
    assert (s.observed_generation, s.desired_replicas, s.endpoint) == (4, 2, "http://gw/v1")
    assert s.selector == "servefleet.io/component=engine,servefleet.io/llmdeployment=m"


def test_warm_pool_ready_and_complete() -> None:
    s = compute_status(dep(), Observed(deployment(2, 2)), "e", NOW)
    assert cond(s, "Ready") == ("True", "WarmPoolReady")
    assert cond(s, "Progressing") == ("False", "Complete")
    assert (s.replicas, s.ready_replicas, s.warm_replicas) == (2, 2, 2)


def test_scaling_above_the_warm_pool() -> None:
    s = compute_status(dep(replicas=4), Observed(deployment(4, 3)), "e", NOW)
    assert cond(s, "Ready") == ("True", "WarmPoolReady")
    assert cond(s, "Progressing") == ("True", "ScalingUp")
    assert s.warm_replicas == 2


def test_rolling_out() -> None:
    s = compute_status(dep(), Observed(deployment(3, 2, updated=1)), "e", NOW)
    assert cond(s, "Progressing") == ("True", "RollingOut")
    assert "1/2 replicas on the new spec" in (s.condition("Progressing") or s.conditions[0]).message


def test_stale_deployment_counts_as_progressing() -> None:
    s = compute_status(dep(), Observed(deployment(2, 2, current=False)), "e", NOW)
    assert cond(s, "Progressing")[0] == "True"


def test_degraded_reasons() -> None:
    stalled = deployment(
        2,
        1,
        Progressing={
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": "took too long",
        },
    )
    assert cond(compute_status(dep(), Observed(stalled), "e", NOW), "Degraded") == (
        "True",
        "ProgressDeadlineExceeded",
    )
    quota = deployment(1, 1, ReplicaFailure={"status": "True", "message": "exceeded quota"})
    assert cond(compute_status(dep(), Observed(quota), "e", NOW), "Degraded") == (
        "True",
        "ReplicaFailure",
    )
    err = compute_status(dep(), Observed(deployment(2, 2), reconcile_error="forbidden"), "e", NOW)
    assert cond(err, "Degraded") == ("True", "ReconcileError")


def test_scale_to_zero_is_ready() -> None:
    s = compute_status(dep(min_replicas=0), Observed(deployment(0, 0)), "e", NOW)
    assert cond(s, "Ready") == ("True", "ScaledToZero")


def test_transition_times_only_move_on_change_and_queue_depth_is_kept() -> None:
    first = compute_status(dep(), Observed(deployment(2, 2)), "e", NOW)
    first.queue_depth = 7
    again = compute_status(dep(status=first), Observed(deployment(2, 2)), "e", LATER)
    assert again == first  # same state: identical status, no patch needed
    assert status_patch(again) == status_patch(first)
    assert "queueDepth" not in status_patch(again)["status"]
    dropped = compute_status(dep(status=first), Observed(deployment(2, 1)), "e", LATER)
    ready = dropped.condition("Ready")
    assert ready is not None and ready.last_transition_time == LATER
    degraded = dropped.condition("Degraded")
    assert degraded is not None and degraded.last_transition_time == NOW


def test_events_on_transitions() -> None:
    empty = LLMDeploymentStatus()
    creating = compute_status(dep(), Observed(None), "e", NOW)
    first = transition_events(empty, creating)
    assert [(e.type, e.reason) for e in first] == [
        ("Normal", "WarmPoolNotReady"),
        ("Normal", "Creating"),
    ]
    ready = compute_status(dep(status=creating), Observed(deployment(2, 2)), "e", NOW)
    assert [(e.type, e.reason) for e in transition_events(creating, ready)] == [
        ("Normal", "WarmPoolReady"),
        ("Normal", "Complete"),
    ]
    assert transition_events(ready, ready) == []
    lost = compute_status(dep(status=ready), Observed(deployment(2, 1)), "e", NOW)
    assert ("Warning", "WarmPoolNotReady") in [
        (e.type, e.reason) for e in transition_events(ready, lost)
    ]
    scaled = compute_status(dep(replicas=4, status=ready), Observed(deployment(2, 2)), "e", NOW)
    assert ("Normal", "Scaled") in [(e.type, e.reason) for e in transition_events(ready, scaled)]


def test_replicas_above_the_pool_are_clamped_and_reported() -> None:
    clamped = compute_status(dep(replicas=9), Observed(deployment(5, 5)), "e", NOW)
    assert clamped.desired_replicas == 5
    assert cond(clamped, "ScalingLimited") == ("True", "ReplicasClamped")
    limited = clamped.condition("ScalingLimited")
    assert limited is not None
    assert limited.message == "spec.replicas 9 is above pool.maxReplicas 5: running 5"
    within = compute_status(dep(replicas=3), Observed(deployment(3, 3)), "e", NOW)
    assert cond(within, "ScalingLimited") == ("False", "WithinBounds")
    events = transition_events(
        within, compute_status(dep(replicas=9), Observed(deployment(5, 5)), "e", LATER)
    )
    assert any(e.reason == "ReplicasClamped" and e.type == "Warning" for e in events)
