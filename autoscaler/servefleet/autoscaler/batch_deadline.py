"""Replicas the open batches' deadlines need (the Batch API on spare capacity).

The gateway reports the line rate that answers every open batch by its deadline, earliest
first (`DeploymentStats.batch_lines_per_second_needed`). A replica answers about
`batch_slots_per_replica / mean_service_s` lines a second, so the deadlines take
ceil(rate x service x SAFETY / slots) replicas. The policy asks for that only when it is more
than the pool has: replicas are bought for a batch only when its window would otherwise be
missed; otherwise batch lines fill whatever slots interactive traffic leaves idle.
"""

from __future__ import annotations

import math

from .signals import Observation
from .targets import ScalingTargets

SAFETY = 1.25
"""Rate margin: interactive requests share the slots, and service times are averages."""


def batch_replicas(observation: Observation, targets: ScalingTargets) -> int:
    """Replicas the open batches need to finish in time; 0 without a batch, a measured
    service time, or batch slots to size by."""
    rate = observation.batch_lines_per_s_needed
    slots = targets.batch_slots_per_replica
    service = observation.mean_service_s
    if rate <= 0 or slots is None or service is None:
        return 0
    return math.ceil(rate * service * SAFETY / slots)
