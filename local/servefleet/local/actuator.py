"""The autoscaler's local backend: tell the supervisor how many processes to keep."""

from __future__ import annotations

from servefleet.autoscaler.policy import Decision
from servefleet.autoscaler.signals import Observation

from .supervisor import DeploymentSupervisor


class LocalActuator:
    def __init__(self, supervisor: DeploymentSupervisor) -> None:
        self._supervisor = supervisor

    async def apply(self, deployment: str, decision: Decision, observation: Observation) -> None:
        # Only a change is an order: a replica that just died is the supervisor's to replace.
        if decision.desired != decision.current:
            self._supervisor.scale(decision.desired, decision.victim)
