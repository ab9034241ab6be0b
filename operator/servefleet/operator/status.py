"""Pure status computation: the observed engine Deployment in, status + Events out.

Kept apart from the handlers so the conditions a person reads in `kubectl describe`
are unit-tested, and so a restarted operator computes the same status from the same
cluster state (it reads, it does not remember).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from servefleet.api.deployment_status import PoolStatus
from servefleet.api.llmdeployment import Condition, LLMDeployment, LLMDeploymentStatus
from servefleet.operator.model_loading import model_loading
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
    # The admin's lists refuse the spec (reason, message): nothing of it was applied.
    refused: tuple[str, str] | None = None
    # Engine pods and their fetch logs, for ModelLoading; None: not read (keep the last).
    pods: list[dict[str, Any]] | None = None
    fetch_logs: dict[str, str] = field(default_factory=dict)
    # The prefill pool's Deployment (disaggregated, or while a removed one still exists).
    prefill_deployment: dict[str, Any] | None = None


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


@dataclass(frozen=True)
class _Rollout:
    """The engine Deployment's counts, and what the conditions are stamped with."""

    desired: int
    min_replicas: int
    replicas: int
    ready: int
    updated: int
    available: int
    current: bool  # the Deployment controller has seen the latest generation
    exists: bool
    previous: list[Condition]
    now: str
    generation: int

    def condition(self, type_: str, status: bool, reason: str, message: str) -> Condition:
        return _set(self.previous, type_, status, reason, message, self.now, self.generation)


def _rollout(dep: LLMDeployment, observed: Observed, now: str) -> _Rollout:
    deployment = observed.deployment
    dstatus: dict[str, Any] = (deployment or {}).get("status", {}) or {}
    return _Rollout(
        desired=dep.spec.desired_replicas(),
        min_replicas=dep.spec.pool.min_replicas,
        replicas=_int(dstatus, "replicas"),
        ready=_int(dstatus, "readyReplicas"),
        updated=_int(dstatus, "updatedReplicas"),
        available=_int(dstatus, "availableReplicas"),
        current=deployment is not None
        and dstatus.get("observedGeneration", 0)
        >= deployment.get("metadata", {}).get("generation", 0),
        exists=deployment is not None,
        previous=dep.status.conditions,
        now=now,
        generation=dep.metadata.generation or 0,
    )


def _ready(r: _Rollout) -> Condition:
    """Ready: the warm pool is up (and at least one replica when any is wanted)."""
    needed = max(r.min_replicas, 1 if r.desired > 0 else 0)
    if r.desired == 0 and r.ready == 0:
        return r.condition(
            "Ready", True, "ScaledToZero", "no replicas wanted; requests spill or wait"
        )
    if r.ready >= needed:
        message = f"{r.ready}/{r.desired} replicas ready (warm minimum {r.min_replicas})"
        return r.condition("Ready", True, "WarmPoolReady", message)
    message = f"{r.ready}/{r.desired} replicas ready, warm minimum is {r.min_replicas}"
    return r.condition("Ready", False, "WarmPoolNotReady", message)


def _progressing(r: _Rollout, observed: Observed) -> Condition:
    """Progressing: a rollout or a scale is under way (never for a refused spec)."""
    if observed.refused:
        return r.condition("Progressing", False, observed.refused[0], "spec not applied")
    if not r.exists:
        return r.condition("Progressing", True, "Creating", "creating the engine Deployment")
    desired = r.desired
    if r.current and r.updated >= desired and r.replicas <= desired and r.available >= desired:
        return r.condition(
            "Progressing", False, "Complete", f"{desired} replicas on the current spec"
        )
    if r.replicas > r.updated:
        old = r.replicas - r.updated
        reason, message = "RollingOut", f"{r.updated}/{desired} replicas on the new spec, {old} old"
    elif r.replicas < desired or r.available < desired:
        reason, message = "ScalingUp", f"{r.available}/{desired} replicas available"
    elif r.replicas > desired:
        reason, message = "ScalingDown", f"{r.replicas} replicas, scaling down to {desired}"
    else:
        reason, message = "Reconciling", "waiting for the engine Deployment to catch up"
    return r.condition("Progressing", True, reason, message)


def _degraded(r: _Rollout, observed: Observed) -> Condition:
    """Degraded: something a person has to look at."""
    stalled = _deployment_condition(observed.deployment or {}, "Progressing")
    failure = _deployment_condition(observed.deployment or {}, "ReplicaFailure")
    if observed.refused:
        return r.condition("Degraded", True, *observed.refused)
    if observed.reconcile_error:
        return r.condition("Degraded", True, "ReconcileError", observed.reconcile_error)
    if stalled.get("reason") == "ProgressDeadlineExceeded":
        return r.condition("Degraded", True, "ProgressDeadlineExceeded", stalled.get("message", ""))
    if failure.get("status") == "True":
        return r.condition("Degraded", True, "ReplicaFailure", failure.get("message", ""))
    return r.condition("Degraded", False, "AsExpected", "")


def _scaling_limited(r: _Rollout, dep: LLMDeployment) -> Condition:
    """ScalingLimited: spec.replicas is outside the pool bounds and was clamped."""
    limit = dep.spec.replicas_limit()
    if limit is None:
        return r.condition("ScalingLimited", False, "WithinBounds", "")
    message = f"{limit}: running {r.desired}"
    return r.condition("ScalingLimited", True, "ReplicasClamped", message)


def compute_status(
    dep: LLMDeployment, observed: Observed, endpoint: str, now: str
) -> LLMDeploymentStatus:
    """The status the operator should write now (queueDepth and podDeletionCosts are the
    autoscaler's and are kept)."""
    r = _rollout(dep, observed, now)
    return LLMDeploymentStatus(
        observed_generation=r.generation,
        replicas=r.replicas,
        desired_replicas=r.desired,
        ready_replicas=r.ready,
        warm_replicas=min(r.ready, r.min_replicas),
        queue_depth=dep.status.queue_depth,
        pod_deletion_costs=dep.status.pod_deletion_costs,
        endpoint=endpoint,
        selector=selector_string(dep),
        prefill=_prefill(dep, observed),
        conditions=[
            _ready(r),
            _progressing(r, observed),
            _degraded(r, observed),
            _scaling_limited(r, dep),
            *_model_loading(r, dep, observed),
        ],
    )


def _prefill(dep: LLMDeployment, observed: Observed) -> PoolStatus | None:
    """The prefill pool's counts: while the spec declares it, or its Deployment still runs."""
    block, deployment = dep.spec.disaggregation, observed.prefill_deployment
    if block is None and deployment is None:
        return None
    status = (deployment or {}).get("status") or {}
    spec = (deployment or {}).get("spec") or {}
    desired = block.prefill.desired_replicas() if block is not None else 0
    return PoolStatus(
        replicas=_int(status, "replicas"),
        desired_replicas=desired if block is not None else _int(spec, "replicas"),
        ready_replicas=_int(status, "readyReplicas"),
    )


def _model_loading(r: _Rollout, dep: LLMDeployment, observed: Observed) -> list[Condition]:
    """ModelLoading, only for sources that are downloaded (see `model_loading`)."""
    if not dep.spec.model.source.downloads:
        return []
    if observed.pods is None:
        kept = dep.status.condition("ModelLoading")
        return [kept] if kept is not None else []
    status, reason, message = model_loading(observed.pods, observed.fetch_logs)
    return [r.condition("ModelLoading", status, reason, message)]


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
    for type_ in ("Ready", "Progressing", "Degraded", "ScalingLimited", "ModelLoading"):
        before, after = old.condition(type_), new.condition(type_)
        if after is None or (
            before is not None and before.status == after.status and before.reason == after.reason
        ):
            continue
        failed = after.reason == "DownloadFailed"
        if before is None and after.status == "False" and type_ != "Ready" and not failed:
            continue  # "not degraded" / "not progressing" on first sight is not news
        warning = (
            (type_ in ("Degraded", "ScalingLimited") and after.status == "True")
            or (type_ == "Ready" and after.status == "False" and before is not None)
            or failed
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
    """A merge patch for the status subresource that leaves the autoscaler's fields
    (queueDepth, podDeletionCosts) to it."""
    body = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    body.pop("queueDepth", None)
    body.pop("podDeletionCosts", None)
    return {"status": body}
