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
    """Cheapest replica to drain: one never placed first, then a still-starting one (neither
    serves anybody), then the ready one with the least to lose."""
    live = [r for r in replicas if r.state is not ReplicaState.DRAINING]
    if not live:
        return None
    for state in (ReplicaState.PENDING, ReplicaState.STARTING):
        unready = [r for r in live if r.state is state]
        if unready:
            return min(unready, key=drain_cost)
    return min(live, key=drain_cost)


def pod_deletion_costs(replicas: Iterable[ReplicaLoad]) -> dict[str, int]:
    """`controller.kubernetes.io/pod-deletion-cost` per pod: the ReplicaSet removes the lowest.

    Ranks rather than raw loads so the annotation stays a small, stable integer.
    """
    live = sorted((r for r in replicas if r.state is not ReplicaState.DRAINING), key=drain_cost)
    return {r.name: rank for rank, r in enumerate(live)}
