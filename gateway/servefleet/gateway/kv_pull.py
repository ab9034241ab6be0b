"""Cross-replica prefix reuse, the gateway's half: name the replica a prompt's prefix is
likely cached on when the request is sent to another one.

The rule (the cost model, kept simple on purpose): routing prefers the replica a prompt's
leading characters are rendezvous-affine to, because its prefix cache most likely holds
that prefix; when that replica is too busy (`affinitySlack`) the request goes to a less
loaded one, and recomputing a long prefix there costs seconds on a CPU where pulling its
KV over the pod network costs tens of milliseconds (SmolLM2: 46 kB per token in float32,
a 2k-token prompt ~94 MB). So a prompt of at least `kv_pull_min_tokens` tokens routed
away from its affine replica carries `kv_transfer_params: {kv_sources: [affine],
deadline_s}`. The engine has the last word: it hashes the prompt's blocks exactly, pulls
only the leading blocks it lacks that the source holds, and recomputes whatever is not in
by the deadline, so a wrong guess costs at most one round trip (a lookup that finds
nothing) and a slow source at most the deadline. vLLM and SGLang engines are sent nothing
(`kv_pull_min_tokens` is null for them).

Failover uses the same field: a stream continued on another replica after its engine died
(`forward.Forwarder._continue`) names the live peers that may hold the prompt's prefix
(`failover_pull_params`), so the new replica pulls the longest chain it finds for the
prompt plus the delivered tokens and recomputes only the tail.

When the gateway knows the real cache contents (`kv_index`, from the engines' KV events) and
the prompt's exact block hashes, the cost model (`kv_cost`) picks the replica instead, and
names the holder as the source only when it predicts the pull beats both recomputing and
waiting for the holder; its deadline is then the model's (half the recompute time saved).
"""

from __future__ import annotations

from typing import Any

from servefleet.api.gateway_config import GatewayDeployment
from servefleet.api.gateway_stats import ReplicaHealth
from servefleet.api.kv_transfer import MAX_SOURCES
from servefleet.api.stream_resume import KV_TRANSFER_PARAMS
from servefleet.gateway.pool_types import Lease
from servefleet.gateway.routing import Replica, ReplicaSet


def kv_pull_params(config: GatewayDeployment, lease: Lease, prompt_tokens: int) -> dict[str, Any]:
    """`{kv_transfer_params: ...}` for a request `lease` sends away from its prefix's
    replica, else nothing."""
    least = config.kv_pull_min_tokens
    if lease.kv_source is None or least is None or prompt_tokens < least:
        return {}
    deadline = config.kv_pull_deadline_seconds
    if lease.kv_deadline_s is not None:  # the cost model's: half the recompute time it saves
        deadline = min(deadline, lease.kv_deadline_s)
    params = {"kv_sources": [lease.kv_source], "deadline_s": deadline}
    return {KV_TRANSFER_PARAMS: params}


def failover_sources(
    replicas: ReplicaSet, dead: Replica, target: Replica, prior: list[str]
) -> list[str]:
    """Live replicas that may hold a broken stream's prefix, likeliest first: those the
    first request named (the affine replica it was sent away from), then the replica the
    prefix is affine to now, then every other ready one; never the dead one nor the target,
    at most `MAX_SOURCES` (the engine looks each up and pulls from the longest holder)."""
    ready = [r.endpoint for r in replicas.replicas.values() if r.state is ReplicaHealth.READY]
    ordered = [*prior, *ready]
    skip = {dead.endpoint, target.endpoint}
    out: list[str] = []
    for endpoint in ordered:
        if endpoint not in skip and endpoint in ready and endpoint not in out:
            out.append(endpoint)
    return out[:MAX_SOURCES]


def failover_pull_params(
    config: GatewayDeployment,
    replicas: ReplicaSet,
    leases: tuple[Lease, Lease],
    body: dict[str, Any],
    tokens: int,
) -> dict[str, Any]:
    """A continuation `body` (prompt + delivered tokens: `tokens` in all) for the second of
    `leases` after the first broke: `kv_transfer_params` names live peers to pull the KV
    from, or is dropped (the first request's source may be the new replica itself, or dead).
    Exact continuations (our engines) only: vLLM and SGLang continue from text."""
    prior = body.pop(KV_TRANSFER_PARAMS, None) or {}
    least = config.kv_pull_min_tokens
    if least is None or not config.exact_continuation or tokens < least:
        return body
    dead, target = leases[0].replica, leases[1].replica
    sources = failover_sources(replicas, dead, target, list(prior.get("kv_sources") or ()))
    if sources:
        deadline = config.kv_pull_deadline_seconds
        body[KV_TRANSFER_PARAMS] = {"kv_sources": sources, "deadline_s": deadline}
    return body
