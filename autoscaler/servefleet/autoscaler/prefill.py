"""The prefill pool of a disaggregated deployment, scaled from its own signal.

A prefill replica's work is prompt tokens, not sequences: the signal is the prompt tokens
queued for and running on the prefill pool (summed over the gateways), against
`disaggregation.prefill.promptTokensPerReplica`. The decode pool keeps the usual policy
(`policy.decide`, the scale subresource). The decision is written as a merge patch of
`spec.disaggregation.prefill.replicas` (the operator renders `<name>-prefill` from it),
clamped to the pool's bounds. Up at once; down only after the demand stayed low for the
decode pool's `scaleDownDelay`, one step to what the demand needs. An unknown signal
(a gateway that does not report it, or none read) holds the pool as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from servefleet.api.conventions import FIELD_MANAGER_AUTOSCALER
from servefleet.api.disaggregation import PrefillPoolSpec
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.kube import KubeClient
from servefleet.kube.resources import LLM_DEPLOYMENTS


@dataclass(frozen=True)
class PrefillState:
    low_since: float | None = None
    """When the demand first needed fewer replicas than run (None: it does not)."""


@dataclass(frozen=True)
class PrefillDecision:
    current: int
    desired: int
    reason: str
    state: PrefillState


def needed_replicas(prompt_tokens: int, pool: PrefillPoolSpec) -> int:
    """Replicas that keep the prompt tokens per replica at the target, within the bounds."""
    wanted = math.ceil(prompt_tokens / pool.prompt_tokens_per_replica)
    return max(pool.min_replicas, min(pool.max_replicas, wanted))


def decide_prefill(
    prompt_tokens: int | None,
    pool: PrefillPoolSpec,
    scale_down_delay: float,
    now: float,
    state: PrefillState,
) -> PrefillDecision:
    current = pool.desired_replicas()
    if prompt_tokens is None:
        return PrefillDecision(current, current, "signal unknown: holding", PrefillState())
    needed = needed_replicas(prompt_tokens, pool)
    if needed > current:
        return PrefillDecision(current, needed, f"{prompt_tokens} prompt tokens", PrefillState())
    if needed == current:
        return PrefillDecision(current, current, "at target", PrefillState())
    low_since = now if state.low_since is None else state.low_since
    if now - low_since < scale_down_delay:
        return PrefillDecision(current, current, "low, waiting", PrefillState(low_since))
    return PrefillDecision(current, needed, f"{prompt_tokens} prompt tokens", PrefillState())


def prefill_replicas_patch(replicas: int) -> dict[str, object]:
    """The merge patch that sets only the prefill pool's replicas."""
    return {"spec": {"disaggregation": {"prefill": {"replicas": replicas}}}}


class PrefillScaler:
    """One disaggregated deployment's prefill pool: decide, then patch when it changes."""

    def __init__(self, kube: KubeClient) -> None:
        self._kube = kube
        self.state = PrefillState()
        self.last: PrefillDecision | None = None

    async def tick(
        self, dep: LLMDeployment, prompt_tokens: int | None, now: float
    ) -> PrefillDecision | None:
        block = dep.spec.disaggregation
        if block is None:
            return None
        pool = block.prefill
        delay = dep.spec.pool.scale_down_delay
        decision = decide_prefill(prompt_tokens, pool, delay, now, self.state)
        self.state, self.last = decision.state, decision
        if decision.desired != decision.current:
            await self._kube.patch(
                LLM_DEPLOYMENTS,
                dep.namespace,
                dep.name,
                prefill_replicas_patch(decision.desired),
                FIELD_MANAGER_AUTOSCALER,
            )
        return decision
