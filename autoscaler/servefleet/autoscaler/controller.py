"""The loop around the pure policy: observe → decide → record → actuate, per deployment.

The clock is injected so tests drive it; the policy state lives here, one per deployment.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from .actuate import Actuator
from .policy import Decision, PolicyState, decide
from .signals import Observation
from .targets import ScalingTargets
from .telemetry import AutoscalerMetrics

log = logging.getLogger(__name__)

Observe = Callable[[], Awaitable[Observation]]


class DeploymentAutoscaler:
    """Autoscaling of one deployment; `tick` is called every `interval`."""

    def __init__(
        self,
        name: str,
        targets: ScalingTargets,
        observe: Observe,
        actuator: Actuator,
        metrics: AutoscalerMetrics,
        object_name: str | None = None,
    ) -> None:
        self.name = name  # in metrics and logs
        self.object_name = object_name or name  # what the actuator scales
        self.targets = targets
        self._observe = observe
        self._actuator = actuator
        self._metrics = metrics
        self.state = PolicyState()
        self.last: Decision | None = None

    def set_observe(self, observe: Observe) -> None:
        """New scrape sources for the next tick (fresh gateway stats, pod list)."""
        self._observe = observe

    async def tick(self, now: float) -> Decision | None:
        try:
            observation = await self._observe()
        except Exception:
            log.exception("autoscaler %s: observe failed; keeping the pool as it is", self.name)
            self._metrics.errors.labels(self.name, "observe").inc()
            return None
        decision = decide(observation, self.targets, now, self.state)
        self.state = decision.state
        self._metrics.record(self.name, decision)
        self._metrics.max_replicas.labels(self.name).set(self.targets.max_replicas)
        if self.last is None or (decision.desired, decision.reason) != (
            self.last.desired,
            self.last.reason,
        ):
            log.info(
                "autoscaler %s: desired %d (current %d, demand %d): %s [%s]",
                self.name,
                decision.desired,
                decision.current,
                decision.demand,
                decision.message or decision.reason.value,
                decision.reason.value,
            )
        self.last = decision
        try:
            await self._actuator.apply(self.object_name, decision, observation)
        except Exception:
            log.exception("autoscaler %s: actuate failed", self.name)
            self._metrics.errors.labels(self.name, "actuate").inc()
        return decision
