"""Carry out a decision: the scale subresource on Kubernetes, or a local supervisor.

Both actuators get the whole decision so they can also say why (an Event) and steer which
replica goes (pod-deletion-cost on Kubernetes, drain that process locally).
"""

from __future__ import annotations

from typing import Protocol

from .kube import KubeClient
from .policy import Decision
from .signals import Observation
from .victim import pod_deletion_costs

POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


class Actuator(Protocol):
    async def apply(self, deployment: str, decision: Decision, observation: Observation) -> None:
        """Make the pool converge to `decision.desired` (a no-op when it already has)."""
        ...


class KubernetesActuator:
    """Writes `spec.replicas` of the LLMDeployment through its scale subresource.

    Before a scale-down every live pod gets a deletion cost ranked by drain cost, the victim
    lowest, so the ReplicaSet controller removes the replica the policy chose.
    """

    def __init__(self, kube: KubeClient, namespace: str) -> None:
        self._kube = kube
        self._namespace = namespace

    async def apply(self, deployment: str, decision: Decision, observation: Observation) -> None:
        if decision.desired == decision.current:
            return  # a pod that died is the ReplicaSet's to replace, not a reason to shrink
        current_spec = await self._kube.get_scale(self._namespace, deployment)
        if current_spec == decision.desired:
            return
        if decision.desired < decision.current:
            costs = pod_deletion_costs(observation.replicas)
            if decision.victim is not None:
                costs[decision.victim] = -1
            for pod, cost in costs.items():
                await self._kube.annotate_pod(self._namespace, pod, {POD_DELETION_COST: str(cost)})
        await self._kube.set_scale(self._namespace, deployment, decision.desired)
        await self._kube.post_event(
            namespace=self._namespace,
            deployment=deployment,
            reason="Scaled",
            message=(
                f"replicas {current_spec} -> {decision.desired}: {decision.reason.value} "
                f"(demand {decision.demand}, current {decision.current}"
                + (f", victim {decision.victim}" if decision.victim else "")
                + ")"
            ),
        )
