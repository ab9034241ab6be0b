"""Carry out a decision: the scale subresource on Kubernetes, or a local supervisor.

Both actuators get the whole decision so they can also say why (an Event) and steer which
replica goes (on Kubernetes, the ranking goes to `status.podDeletionCosts`, which the operator
copies to the pods' pod-deletion-cost before it scales the engine Deployment: the autoscaler
never writes pods; locally, that process is drained).
"""

from __future__ import annotations

from typing import Protocol

from servefleet.api.conventions import FIELD_MANAGER_AUTOSCALER
from servefleet.api.llmdeployment import FULL_API_VERSION, KIND
from servefleet.kube import KubeClient
from servefleet.kube.resources import LLM_DEPLOYMENTS

from .policy import Decision
from .signals import Observation
from .victim import pod_deletion_costs


class Actuator(Protocol):
    async def apply(self, deployment: str, decision: Decision, observation: Observation) -> None:
        """Make the pool converge to `decision.desired` (a no-op when it already has)."""
        ...


class KubernetesActuator:
    """Writes `spec.replicas` of the LLMDeployment through its scale subresource.

    Before a scale-down every live pod is ranked by drain cost, the victim lowest, in
    `status.podDeletionCosts`; the operator writes the ranks to the pods' deletion cost before
    it applies the lower replica count (it reconciles the scale written after this status), so
    the ReplicaSet controller removes the replica the policy chose.
    """

    def __init__(self, kube: KubeClient, namespace: str) -> None:
        self._kube = kube
        self._namespace = namespace

    async def apply(self, deployment: str, decision: Decision, observation: Observation) -> None:
        if decision.desired == decision.current:
            return  # a pod that died is the ReplicaSet's to replace, not a reason to shrink
        current_spec = await self._kube.get_scale(LLM_DEPLOYMENTS, self._namespace, deployment)
        if current_spec == decision.desired:
            return
        if decision.desired < decision.current:
            costs = pod_deletion_costs(observation.replicas)
            if decision.victim is not None:
                costs[decision.victim] = -1
            ranking = [{"pod": pod, "cost": cost} for pod, cost in sorted(costs.items())]
            await self._kube.patch_status(
                LLM_DEPLOYMENTS,
                self._namespace,
                deployment,
                {"status": {"podDeletionCosts": ranking}},
                FIELD_MANAGER_AUTOSCALER,
            )
        await self._kube.set_scale(
            LLM_DEPLOYMENTS, self._namespace, deployment, decision.desired, FIELD_MANAGER_AUTOSCALER
        )
        await self._kube.create_event(
            {
                "apiVersion": FULL_API_VERSION,
                "kind": KIND,
                "metadata": {"name": deployment, "namespace": self._namespace},
            },
            component=FIELD_MANAGER_AUTOSCALER,
            reason="Scaled",
            message=(
                f"replicas {'unset' if current_spec is None else current_spec} -> "
                f"{decision.desired}: {decision.message or decision.reason.value} "
                f"(reason {decision.reason.value}, demand {decision.demand}"
                + (f", victim {decision.victim}" if decision.victim else "")
                + ")"
            ),
        )
