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

When the gateway knows the real cache contents (`kv_index`, from the engines' KV events) and
the prompt's exact block hashes, the cost model (`kv_cost`) picks the replica instead, and
names the holder as the source only when it predicts the pull beats both recomputing and
waiting for the holder; its deadline is then the model's (half the recompute time saved).
"""

from __future__ import annotations

from typing import Any

from servefleet.api.gateway_config import GatewayDeployment
from servefleet.api.stream_resume import KV_TRANSFER_PARAMS
from servefleet.gateway.pool_types import Lease


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
