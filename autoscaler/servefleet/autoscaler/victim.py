"""Which replica to remove on scale-down: the one whose drain costs least.

Fewest in-flight requests first (it finishes draining soonest and interrupts fewest users),
then least KV cache in use (it holds the least warm prefix cache worth keeping).
"""

from __future__ import annotations

from collections.abc import Iterable

from .signals import ReplicaLoad, ReplicaState


def drain_cost(replica: ReplicaLoad) -> tuple[int, float, str]:
    """Sort key: lower is a cheaper victim. The name breaks ties so choices are stable."""
    return (replica.in_flight, replica.kv_cache_usage, replica.name)


def pick_victim(replicas: Iterable[ReplicaLoad]) -> ReplicaLoad | None:
    """Cheapest replica to drain; a still-starting one beats any ready one (it serves nobody)."""
    live = [r for r in replicas if r.state is not ReplicaState.DRAINING]
    if not live:
        return None
    starting = [r for r in live if r.state is ReplicaState.STARTING]
    return min(starting or live, key=drain_cost)


def pod_deletion_costs(replicas: Iterable[ReplicaLoad]) -> dict[str, int]:
    """`controller.kubernetes.io/pod-deletion-cost` per pod: the ReplicaSet removes the lowest.

    Ranks rather than raw loads so the annotation stays a small, stable integer.
    """
    live = sorted((r for r in replicas if r.state is not ReplicaState.DRAINING), key=drain_cost)
    return {r.name: rank for rank, r in enumerate(live)}
