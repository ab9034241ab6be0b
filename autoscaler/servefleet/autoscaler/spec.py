"""LLMDeployment spec → the policy's `ScalingTargets` (the only place that knows both)."""

from __future__ import annotations

from servefleet.api.llmdeployment import LLMDeploymentSpec, batch_reserve

from .targets import ScalingTargets

DEFAULT_COLD_START_S = 30.0
"""Assumed until the first replica has been timed from start to ready."""


def targets_from_spec(
    spec: LLMDeploymentSpec, cold_start_s: float = DEFAULT_COLD_START_S
) -> ScalingTargets:
    # Rent-or-buy is on with autoscaling.prices; the prices are spec.prices (the spec holds
    # both when it is on), the hosted table's mean for a spilled token of either kind.
    rent_or_buy = spec.autoscaling.prices
    prices = spec.prices if rent_or_buy else None
    hosted = prices.hosted if prices else None
    return ScalingTargets(
        min_replicas=spec.pool.min_replicas,
        max_replicas=spec.pool.max_replicas,
        target_per_replica=spec.autoscaling.target_per_replica,
        batch_slots_per_replica=batch_slots(spec),
        scale_down_delay_s=spec.pool.scale_down_delay,
        queue_wait_target_s=spec.autoscaling.queue_wait_target,
        ttft_target_s=spec.autoscaling.ttft_target,
        default_cold_start_s=cold_start_s,
        replica_cost_per_hour=prices.replica_hour if prices else None,
        spill_cost_per_million_tokens=hosted.per_million_tokens() if hosted else None,
        spill_patience=rent_or_buy.spill_patience if rent_or_buy else 1.0,
    )


def batch_slots(spec: LLMDeploymentSpec) -> int:
    """Slots of a replica batch-class requests may hold (what the gateway leaves them)."""
    cap = spec.pool.per_replica_concurrency
    return cap - batch_reserve(cap, spec.admission)
