"""Where one request goes: the replica, and where its prefix's KV may be pulled from.

By the cached contents first (`kv_cost`: a hashed prompt, an adapter's too once its
replicas agree on its identity: `endpoints.chain_root`), else by the affinity
rule (`routing`): the prompt's affine replica unless it is much busier than the least-loaded
one, preferring holders of the request's LoRA adapter. A request of the batch class sees each
replica `reserve` slots smaller (the slots kept free for interactive requests). Pure choice:
the pool takes the slot and counts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from servefleet.api.gateway_config import GatewayDeployment
from servefleet.gateway.kv_cost import Decision, route_by_contents
from servefleet.gateway.kv_index import KVIndex
from servefleet.gateway.pool_types import PoolRequest
from servefleet.gateway.routing import Replica, ReplicaSet


@dataclass(frozen=True, slots=True)
class Target:
    replica: Replica
    kv_source: str | None = None  # a replica the chosen one may pull the prefix's KV from
    kv_deadline_s: float | None = None  # how long that pull may take before recomputing


def choose_target(
    replicas: ReplicaSet,
    kv_index: KVIndex,
    config: GatewayDeployment,
    request: PoolRequest,
    now: float,
    *,
    slack: int,
    reserve: int,
) -> tuple[Target | None, Decision | None]:
    """(where the request goes or None when no replica has room, the KV routing decision
    to count or None when its prompt was not routed by contents)."""
    if request.block_hashes:
        option = route_by_contents(
            replicas.replicas.values(), kv_index, request.block_hashes, now, config, reserve
        )
        if option is not None:
            source = None if option.source is None else option.source.endpoint
            return Target(option.replica, source, option.deadline_s), option.decision
        decision: Decision | None = "local"
    else:
        decision = None
    replica = replicas.pick(
        request.affinity_key, now, slack=slack, adapter=request.adapter, reserve=reserve
    )
    if replica is None:
        return None, decision
    affine = replicas.kv_source(request.affinity_key, replica)
    return Target(replica, None if affine is None else affine.endpoint), decision
