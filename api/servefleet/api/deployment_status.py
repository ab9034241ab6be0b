"""The LLMDeployment's status: what the operator observed, written through the status
subresource (the autoscaler writes only `queueDepth` and `podDeletionCosts`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from servefleet.api.api_model import ApiModel

ConditionType = Literal["Ready", "Progressing", "Degraded", "ScalingLimited", "ModelLoading"]


class Condition(ApiModel):
    """A standard Kubernetes condition."""

    type: str = Field(description="Ready, Progressing, Degraded, ScalingLimited or ModelLoading.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason for the last transition.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str | None = Field(
        default=None,
        description="When the status last changed (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    observed_generation: int | None = Field(
        default=None, description="Generation this condition was computed for."
    )


class PodDeletionCost(ApiModel):
    """One engine pod's rank for the next scale-down (the lowest is removed first)."""

    pod: str = Field(description="Name of the engine pod.", max_length=253)
    cost: int = Field(description="Its controller.kubernetes.io/pod-deletion-cost.")


class PoolStatus(ApiModel):
    """A second pool's counts (the prefill pool of a disaggregated deployment)."""

    replicas: int = Field(default=0, description="Pods that exist.")
    desired_replicas: int = Field(default=0, description="Replicas the operator converges to.")
    ready_replicas: int = Field(default=0, description="Replicas ready to serve.")


class LLMDeploymentStatus(ApiModel):
    """What the operator observed; written through the status subresource."""

    observed_generation: int = Field(
        default=0, description="Last spec generation the operator acted on."
    )
    replicas: int = Field(
        default=0, description="Engine pods that exist (the scale subresource's status.replicas)."
    )
    desired_replicas: int = Field(default=0, description="Replicas the operator is converging to.")
    ready_replicas: int = Field(default=0, description="Replicas with the model loaded and ready.")
    warm_replicas: int = Field(
        default=0, description="Ready replicas counted toward the warm minimum."
    )
    queue_depth: int = Field(
        default=0, description="Requests waiting in the gateway for this deployment."
    )
    endpoint: str = Field(
        default="", description="OpenAI base URL that serves this model (through the gateway)."
    )
    selector: str = Field(
        default="", description="Label selector of the engine pods (for the scale subresource)."
    )
    pod_deletion_costs: list[PodDeletionCost] = Field(
        default_factory=list,
        max_length=1000,
        description="Written by the autoscaler before it lowers spec.replicas: the engine pods "
        "ranked by what draining them costs. The operator copies each to its pod's "
        "controller.kubernetes.io/pod-deletion-cost annotation before it scales the engine "
        "Deployment, so the ReplicaSet removes the idlest replica and the autoscaler needs no "
        "write access to pods.",
    )
    prefill: PoolStatus | None = Field(
        default=None,
        description="The prefill pool (spec.disaggregation); the fields above are the decode "
        "pool's.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, Degraded, ScalingLimited and ModelLoading.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)
