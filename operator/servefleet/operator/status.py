"""Pure status computation: the observed engine Deployment in, status + Events out.

Kept apart from the handlers so the conditions a person reads in `kubectl describe`
are unit-tested, and so a restarted operator computes the same status from the same
cluster state (it reads, it does not remember).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from servefleet.api.llmdeployment import Condition, LLMDeployment, LLMDeploymentStatus
from servefleet.operator.render import selector_string


@dataclass(frozen=True)
class EventSpec:
    """A Kubernetes Event to post on the LLMDeployment."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Observed:
    """What the handlers read from the cluster for one LLMDeployment."""

    deployment: dict[str, Any] | None
    reconcile_error: str | None = None


def _int(status: dict[str, Any], key: str) -> int:
    return int(status.get(key) or 0)


def _deployment_condition(deployment: dict[str, Any], type_: str) -> dict[str, Any]:
    for cond in deployment.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == type_:
            return dict(cond)
    return {}


def _set(
    previous: list[Condition],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: str,
    generation: int,
) -> Condition:
    text: Literal["True", "False"] = "True" if status else "False"
    old = next((c for c in previous if c.type == type_), None)
    changed = old is None or old.status != text
    return Condition(
        type=type_,
        status=text,
        reason=reason,
        message=message,
        last_transition_time=now if changed or old is None else old.last_transition_time,
        observed_generation=generation,
    )


def compute_status(
    dep: LLMDeployment, observed: Observed, endpoint: str, now: str
) -> LLMDeploymentStatus:
    """The status the operator should write now (queueDepth is the autoscaler's and is kept)."""
    spec = dep.spec
    generation = dep.metadata.generation or 0
    desired = spec.desired_replicas()
    min_replicas = spec.pool.min_replicas
    deployment = observed.deployment
    dstatus: dict[str, Any] = (deployment or {}).get("status", {}) or {}
    replicas = _int(dstatus, "replicas")
    ready = _int(dstatus, "readyReplicas")
    updated = _int(dstatus, "updatedReplicas")
    available = _int(dstatus, "availableReplicas")
    deployment_current = deployment is not None and (
        (deployment.get("status", {}) or {}).get("observedGeneration", 0)
        >= deployment.get("metadata", {}).get("generation", 0)
    )
    previous = dep.status.conditions

    # Ready: the warm pool is up (and at least one replica when any is wanted).
    needed = max(min_replicas, 1 if desired > 0 else 0)
    if desired == 0 and ready == 0:
        ready_cond = _set(
            previous,
            "Ready",
            True,
            "ScaledToZero",
            "no replicas wanted; requests spill or wait",
            now,
            generation,
        )
    elif ready >= needed:
        ready_cond = _set(
            previous,
            "Ready",
            True,
            "WarmPoolReady",
            f"{ready}/{desired} replicas ready (warm minimum {min_replicas})",
            now,
            generation,
        )
    else:
        ready_cond = _set(
            previous,
            "Ready",
            False,
            "WarmPoolNotReady",
            f"{ready}/{desired} replicas ready, warm minimum is {min_replicas}",
            now,
            generation,
        )

    # Progressing: a rollout or a scale is under way.
    if deployment is None:
        progressing = _set(
            previous,
            "Progressing",
            True,
            "Creating",
            "creating the engine Deployment",
            now,
            generation,
        )
    elif not deployment_current or updated < desired or replicas > desired or available < desired:
        if replicas > updated:
            reason, message = (
                "RollingOut",
                f"{updated}/{desired} replicas on the new spec, {replicas - updated} old",
            )
        elif replicas < desired or available < desired:
            reason, message = "ScalingUp", f"{available}/{desired} replicas available"
        elif replicas > desired:
            reason, message = "ScalingDown", f"{replicas} replicas, scaling down to {desired}"
        else:
            reason, message = "Reconciling", "waiting for the engine Deployment to catch up"
        progressing = _set(previous, "Progressing", True, reason, message, now, generation)
    else:
        progressing = _set(
            previous,
            "Progressing",
            False,
            "Complete",
            f"{desired} replicas on the current spec",
            now,
            generation,
        )

    # Degraded: something a person has to look at.
    stalled = _deployment_condition(deployment or {}, "Progressing")
    failure = _deployment_condition(deployment or {}, "ReplicaFailure")
    if observed.reconcile_error:
        degraded = _set(
            previous, "Degraded", True, "ReconcileError", observed.reconcile_error, now, generation
        )
    elif stalled.get("reason") == "ProgressDeadlineExceeded":
        degraded = _set(
            previous,
            "Degraded",
            True,
            "ProgressDeadlineExceeded",
            stalled.get("message", ""),
            now,
            generation,
        )
    elif failure.get("status") == "True":
        degraded = _set(
            previous,
            "Degraded",
            True,
            "ReplicaFailure",
            failure.get("message", ""),
            now,
            generation,
        )
    else:
        degraded = _set(previous, "Degraded", False, "AsExpected", "", now, generation)

    return LLMDeploymentStatus(
        observed_generation=generation,
        replicas=replicas,
        desired_replicas=desired,
        ready_replicas=ready,
        warm_replicas=min(ready, min_replicas),
        queue_depth=dep.status.queue_depth,
        endpoint=endpoint,
        selector=selector_string(dep),
        conditions=[ready_cond, progressing, degraded],
    )


def transition_events(old: LLMDeploymentStatus, new: LLMDeploymentStatus) -> list[EventSpec]:
    """Events for changes a person wants to see in `kubectl describe`/`get events`."""
    events: list[EventSpec] = []
    if old.desired_replicas != new.desired_replicas and old.observed_generation > 0:
        events.append(
            EventSpec(
                "Normal",
                "Scaled",
                f"desired replicas {old.desired_replicas} -> {new.desired_replicas}",
            )
        )
    for type_ in ("Ready", "Progressing", "Degraded"):
        before, after = old.condition(type_), new.condition(type_)
        if after is None or (
            before is not None and before.status == after.status and before.reason == after.reason
        ):
            continue
        if before is None and after.status == "False" and type_ != "Ready":
            continue  # "not degraded" / "not progressing" on first sight is not news
        warning = (type_ == "Degraded" and after.status == "True") or (
            type_ == "Ready" and after.status == "False" and before is not None
        )
        events.append(
            EventSpec(
                "Warning" if warning else "Normal",
                after.reason,
                f"{type_}={after.status}: {after.message}".rstrip(": "),
            )
        )
    return events


def status_patch(status: LLMDeploymentStatus) -> dict[str, Any]:
    """A merge patch for the status subresource that leaves queueDepth to the autoscaler."""
    body = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    body.pop("queueDepth", None)
    return {"status": body}
