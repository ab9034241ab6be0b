"""Replicas bigger than one pod: a LeaderWorkerSet instead of a Deployment. Pure.

When `engine.pods_per_replica()` (the rule of `servefleet.api.parallel`) is above one, each
replica is a group of that many pods, and the engine workload is a LeaderWorkerSet
(sigs.k8s.io/lws, `leaderworkerset.x-k8s.io/v1`): `replicas` counts groups (its scale
subresource is what an HPA would scale), `size` pods per group, pod 0 the leader. The
group is the unit everywhere:

- routing and scraping see leaders only: the Service and `status.selector` (which the
  autoscaler lists pods with) add `leaderworkerset.sigs.k8s.io/worker-index: "0"`, so one
  endpoint, one scraped replica, one scaled unit is one group;
- readiness is the group's: workers carry no probes, the leader's readiness needs its
  workers (the engine serves only once every rank joined), and LWS counts a group ready
  when all its pods are;
- restarts are all-or-nothing (`RecreateGroupOnPodRestart`): a rank that dies takes its
  group down and LWS recreates the whole group, as no engine survives a lost rank;
- a group leaving (scale-down, rollout) drains through its leader: workers wait
  `drainTimeoutSeconds` in a preStop sleep so the leader finishes in-flight requests with
  its ranks alive. LWS removes the highest-indexed groups first (StatefulSet order), so the
  autoscaler's per-pod victim ranking does not apply to groups.

Rendezvous per engine kind, from the env LWS's pod webhook sets (`LWS_LEADER_ADDRESS`,
`LWS_GROUP_SIZE`, `LWS_WORKER_INDEX`), expanded by the kubelet:

- servefleet: torch's env:// variables (MASTER_ADDR = the leader, RANK = worker index,
  WORLD_SIZE = group size) on every pod, same command;
- vLLM (its LWS recipe): the leader starts a Ray head and `vllm serve` with the Ray
  executor; workers `ray start --address=$LWS_LEADER_ADDRESS:6379 --block`;
- SGLang: every pod runs the server with `--nnodes`, `--node-rank $LWS_WORKER_INDEX` and
  `--dist-init-addr $LWS_LEADER_ADDRESS:29500`.
"""

from __future__ import annotations

import copy
from typing import Any

from servefleet.api.conventions import engine_selector
from servefleet.api.engines import engine_adapter
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.api.parallel import (
    LEADER_WORKER_INDEX,
    LWS_GROUP_SIZE_ENV,
    LWS_LEADER_ADDRESS_ENV,
    LWS_WORKER_INDEX_ENV,
    LWS_WORKER_INDEX_LABEL,
    MASTER_ADDR_ENV,
    MASTER_PORT_ENV,
    RANK_ENV,
    RAY_PORT,
    RENDEZVOUS_PORT,
    WORLD_SIZE_ENV,
)

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
RESTART_POLICY = "RecreateGroupOnPodRestart"
STARTUP_POLICY = "LeaderCreated"
"""Workers start with their leader, not after it is ready: the leader is ready only once
every rank has joined, so `LeaderReady` would never start them."""
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def pods_per_replica(dep: LLMDeployment) -> int:
    return dep.spec.engine.pods_per_replica()


def is_group(dep: LLMDeployment) -> bool:
    """Whether a replica spans pods (then its engine workload is a LeaderWorkerSet)."""
    return pods_per_replica(dep) > 1


def replica_selector(dep: LLMDeployment) -> dict[str, str]:
    """The pods that stand for replicas (Service, status.selector, autoscaler): every engine
    pod, or the leaders when a replica is a group."""
    labels = engine_selector(dep.name)
    if is_group(dep):
        labels[LWS_WORKER_INDEX_LABEL] = LEADER_WORKER_INDEX
    return labels


def _var(name: str) -> str:
    return f"$({name})"


def _env(name: str, value: str) -> dict[str, str]:
    return {"name": name, "value": value}


def _torch_env() -> list[dict[str, str]]:
    return [
        _env(MASTER_ADDR_ENV, _var(LWS_LEADER_ADDRESS_ENV)),
        _env(MASTER_PORT_ENV, str(RENDEZVOUS_PORT)),
        _env(RANK_ENV, _var(LWS_WORKER_INDEX_ENV)),
        _env(WORLD_SIZE_ENV, _var(LWS_GROUP_SIZE_ENV)),
    ]


def _sglang_flags() -> list[str]:
    return [
        "--nnodes",
        _var(LWS_GROUP_SIZE_ENV),
        "--node-rank",
        _var(LWS_WORKER_INDEX_ENV),
        "--dist-init-addr",
        f"{_var(LWS_LEADER_ADDRESS_ENV)}:{RENDEZVOUS_PORT}",
    ]


def _leader(container: dict[str, Any], kind: str) -> None:
    """The leader's container: serves the API (rank 0), joined by its workers."""
    if kind == "servefleet":
        container["env"] = [*_torch_env(), *container["env"]]
    elif kind == "sglang":
        container["args"] = [*container["args"], *_sglang_flags()]
    else:  # vllm: a Ray head, then the server spanning the Ray cluster
        serve = [*container["command"], *container["args"], "--distributed-executor-backend", "ray"]
        script = f'ray start --head --port={RAY_PORT} && exec "$@"'
        container["command"] = ["sh", "-c", script, "vllm-leader", *serve]
        container["args"] = []


def _worker(container: dict[str, Any], kind: str, drain_seconds: int) -> None:
    """A worker's container: a rank of the leader's engine; no probes (the group is ready
    when its leader is), alive through the leader's drain."""
    for probe in PROBES:
        container.pop(probe, None)
    container["ports"] = []
    container["lifecycle"] = {"preStop": {"sleep": {"seconds": max(1, drain_seconds)}}}
    if kind == "servefleet":
        container["env"] = [*_torch_env(), *container["env"]]
    elif kind == "sglang":
        container["args"] = [*container["args"], *_sglang_flags()]
    else:
        join = f'exec ray start --address="${LWS_LEADER_ADDRESS_ENV}:{RAY_PORT}" --block'
        container["command"] = ["sh", "-c", join]
        container["args"] = []


def group_templates(
    dep: LLMDeployment, template: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The leader's and the workers' pod templates, from the one-pod engine template."""
    kind = engine_adapter(dep.spec.engine.kind).kind
    leader, worker = copy.deepcopy(template), copy.deepcopy(template)
    _leader(leader["spec"]["containers"][0], kind)
    _worker(worker["spec"]["containers"][0], kind, dep.spec.engine.drain_timeout_seconds)
    return leader, worker


def leader_worker_set(
    dep: LLMDeployment, meta: dict[str, Any], replicas: int, template: dict[str, Any]
) -> dict[str, Any]:
    """The engine workload of a deployment whose replicas are groups. maxUnavailable 0 /
    maxSurge 1, as the Deployment: a rollout adds a new group and waits until it is ready
    before an old one goes, so ready groups never drop below the warm minimum."""
    leader, worker = group_templates(dep, template)
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": meta,
        "spec": {
            "replicas": replicas,
            "startupPolicy": STARTUP_POLICY,
            # One headless Service for every group: LWS_LEADER_ADDRESS is
            # <lws>-<group>.<lws>.<namespace>, resolvable from every rank.
            "networkConfig": {"subdomainPolicy": "Shared"},
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "leaderWorkerTemplate": {
                "size": pods_per_replica(dep),
                "restartPolicy": RESTART_POLICY,
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def group_disruption_budget(dep: LLMDeployment, replicas: int) -> dict[str, Any]:
    """A PodDisruptionBudget counts pods, and evicting any pod of a group takes the whole
    group: so at most (groups - warm minimum) pods may be evicted at once, each costing at
    most one group (one at a time without a warm minimum)."""
    minimum = dep.spec.pool.min_replicas
    return {"maxUnavailable": max(0, replicas - minimum) if minimum > 0 else 1}


def as_deployment_status(lws: dict[str, Any] | None) -> dict[str, Any] | None:
    """A LeaderWorkerSet read as the Deployment `status` reads it (`status.py`): replicas,
    ready and updated count groups; a group is available when it is ready."""
    if lws is None:
        return None
    status = dict(lws.get("status") or {})
    status.setdefault("availableReplicas", status.get("readyReplicas", 0))
    return {**lws, "status": status}
