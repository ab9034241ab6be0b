"""`spec.scheduling`: where engine pods may run, as in a Pod spec.

Typed field by field (not free-form objects) so the CRD carries a real schema: a misspelt
`tolerations[0].efect` or an unknown operator is refused at admission, not silently
dropped by the API server's pruning and then missing from every pod.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from servefleet.api.api_model import DNS_SUBDOMAIN, ApiModel

LabelValue = Annotated[str, Field(description="A label value.")]

# --------------------------------------------------------------------------- selectors


class LabelSelectorRequirement(ApiModel):
    """One `matchExpressions` entry of a label selector."""

    key: str = Field(description="Label key.", min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In, NotIn, Exists or DoesNotExist."
    )
    values: list[str] = Field(
        default_factory=list, description="Values for In and NotIn; empty otherwise."
    )


class LabelSelector(ApiModel):
    """A label selector, as in a Pod spec."""

    match_labels: dict[str, LabelValue] = Field(
        default_factory=dict, description="Labels to match."
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, description="Set-based requirements, ANDed."
    )


class NodeSelectorRequirement(ApiModel):
    """One requirement on a node's labels or fields."""

    key: str = Field(description="Label (or field) key.", min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(
        description="In, NotIn, Exists, DoesNotExist, Gt or Lt."
    )
    values: list[str] = Field(default_factory=list, description="Values to compare with.")


class NodeSelectorTerm(ApiModel):
    """Requirements ANDed; the terms of a node selector are ORed."""

    match_expressions: list[NodeSelectorRequirement] = Field(
        default_factory=list, description="Requirements on node labels."
    )
    match_fields: list[NodeSelectorRequirement] = Field(
        default_factory=list, description="Requirements on node fields."
    )


# --------------------------------------------------------------------------- affinity


class NodeSelector(ApiModel):
    """Nodes matching any of the terms."""

    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1, description="Terms, ORed.")


class PreferredSchedulingTerm(ApiModel):
    """A weighted node preference."""

    weight: int = Field(ge=1, le=100, description="Weight, 1..100.")
    preference: NodeSelectorTerm = Field(description="The nodes preferred.")


class NodeAffinity(ApiModel):
    """Node affinity, as in a Pod spec."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = Field(
        default=None, description="Nodes a pod must run on."
    )
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, description="Nodes a pod should run on, weighted."
    )


class PodAffinityTerm(ApiModel):
    """Pods (by labels) that must or must not share a topology domain with this one."""

    label_selector: LabelSelector | None = Field(default=None, description="The pods.")
    namespace_selector: LabelSelector | None = Field(
        default=None, description="Namespaces of those pods (unset: this pod's namespace)."
    )
    namespaces: list[str] = Field(default_factory=list, description="Namespaces, by name.")
    topology_key: str = Field(
        min_length=1, description="Node label of the domain, e.g. kubernetes.io/hostname."
    )
    match_label_keys: list[str] = Field(
        default_factory=list, description="Pod label keys whose values must also match."
    )
    mismatch_label_keys: list[str] = Field(
        default_factory=list, description="Pod label keys whose values must differ."
    )


class WeightedPodAffinityTerm(ApiModel):
    """A weighted pod (anti-)affinity preference."""

    weight: int = Field(ge=1, le=100, description="Weight, 1..100.")
    pod_affinity_term: PodAffinityTerm = Field(description="The term.")


class PodAffinity(ApiModel):
    """Pod affinity or anti-affinity, as in a Pod spec."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(
        default_factory=list, description="Terms a pod must satisfy."
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, description="Terms a pod should satisfy, weighted."
    )


class Affinity(ApiModel):
    """Affinity, as in a Pod spec."""

    node_affinity: NodeAffinity | None = Field(default=None, description="Node affinity.")
    pod_affinity: PodAffinity | None = Field(default=None, description="Pod affinity.")
    pod_anti_affinity: PodAffinity | None = Field(default=None, description="Pod anti-affinity.")


# --------------------------------------------------------------------------- taints, spread


class Toleration(ApiModel):
    """A toleration, as in a Pod spec."""

    key: str | None = Field(default=None, description="Taint key (unset with Exists: any).")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value (Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect (unset: every effect)."
    )
    toleration_seconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated (unset: forever)."
    )


class TopologySpreadConstraint(ApiModel):
    """A topology spread constraint, as in a Pod spec. Without a labelSelector it spreads
    this deployment's engine pods (the operator fills in their selector)."""

    max_skew: int = Field(ge=1, description="Most pods one domain may have over the least.")
    topology_key: str = Field(min_length=1, description="Node label of the domain.")
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(
        description="DoNotSchedule or ScheduleAnyway."
    )
    label_selector: LabelSelector | None = Field(
        default=None, description="Pods counted (unset: this deployment's engine pods)."
    )
    min_domains: int | None = Field(default=None, ge=1, description="Fewest eligible domains.")
    match_label_keys: list[str] = Field(
        default_factory=list, description="Pod label keys whose values select the pods counted."
    )
    node_affinity_policy: Literal["Honor", "Ignore"] | None = Field(
        default=None, description="Whether nodeAffinity/nodeSelector limit the domains."
    )
    node_taints_policy: Literal["Honor", "Ignore"] | None = Field(
        default=None, description="Whether taints limit the domains."
    )


# --------------------------------------------------------------------------- the section


class SchedulingSpec(ApiModel):
    """Where engine pods run; every field is copied into the engine pods unchanged."""

    node_selector: dict[str, LabelValue] = Field(
        default_factory=dict, description="Node labels a pod's node must have."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=50,
        description="Taints tolerated (GPU pods also tolerate nvidia.com/gpu by default).",
    )
    affinity: Affinity | None = Field(default=None, description="Node and pod (anti-)affinity.")
    priority_class_name: str | None = Field(
        default=None,
        pattern=DNS_SUBDOMAIN,
        max_length=253,
        description="PriorityClass of the engine pods.",
    )
    runtime_class_name: str | None = Field(
        default=None,
        pattern=DNS_SUBDOMAIN,
        max_length=253,
        description="RuntimeClass of the engine pods (e.g. 'nvidia').",
    )
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(
        default_factory=list, max_length=10, description="How replicas spread over domains."
    )
