"""Replicas bigger than one pod: the names and the one rule every component shares.

`engine.tensorParallelSize` (TP) and `engine.pipelineParallelSize` (PP), spelled as vLLM
spells them, say how one replica shards the model. The rule for how many pods that takes
follows vLLM's LeaderWorkerSet recipe: one pod per node, tensor parallelism within a pod,
pipeline parallelism across pods.

- vLLM / SGLang: a pod holds G GPUs (`engine.resources`). When TP × PP fits in G, the
  replica is one pod. Otherwise each pod is one pipeline stage, so TP must equal G and the
  replica spans PP pods.
- servefleet (our engine): one process, hence one rank, per pod (at most one GPU each); a
  replica of TP × PP > 1 spans TP × PP pods, rank r of WORLD_SIZE = TP × PP being the
  pod of LeaderWorkerSet worker index r (torch's standard rendezvous variables below).
  TP and PP combine as in vLLM: rank r is tensor shard r mod TP of pipeline stage r // TP.

A group of pods is one replica everywhere: it is scaled, routed to (through its leader),
counted ready and drained as a whole.
"""

from __future__ import annotations

TENSOR_PARALLEL_FLAG = "--tensor-parallel-size"
PIPELINE_PARALLEL_FLAG = "--pipeline-parallel-size"
"""Flags our engine and vLLM read (SGLang spells them `--tp-size` / `--pp-size`)."""

MASTER_ADDR_ENV = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"
RANK_ENV = "RANK"
WORLD_SIZE_ENV = "WORLD_SIZE"
"""torch.distributed's env:// rendezvous: our engine's ranks of one replica meet at
MASTER_ADDR:MASTER_PORT (the leader pod, rank 0)."""

RENDEZVOUS_PORT = 29500
"""torch's customary MASTER_PORT; SGLang's `--dist-init-addr` port too."""

RAY_PORT = 6379
"""The Ray head's port on a vLLM leader (vLLM spans pods through Ray)."""

MAX_PODS_PER_REPLICA = 64

# LeaderWorkerSet's own names (sigs.k8s.io/lws): its pod webhook sets these on every pod.
LWS_LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
LWS_GROUP_SIZE_ENV = "LWS_GROUP_SIZE"
LWS_WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
"""'0' on a group's leader pod: Services select it to route only to leaders."""
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LEADER_WORKER_INDEX = "0"


def pods_per_replica(kind: str, tensor: int, pipeline: int, gpus: int) -> int:
    """Pods one replica spans (the rule above); assumes a spec `group_refusal` accepts."""
    ranks = tensor * pipeline
    if kind == "servefleet":
        return ranks
    return 1 if ranks <= max(1, gpus) else pipeline


def group_refusal(kind: str, tensor: int, pipeline: int, gpus: int) -> str | None:
    """Why a spec's parallelism does not make whole pods (the CEL rules say the same), or None."""
    ranks = tensor * pipeline
    if kind == "servefleet":
        if ranks > 1 and gpus > 1:
            return OURS_ONE_GPU_MESSAGE
        if ranks > MAX_PODS_PER_REPLICA:
            return OURS_TOO_MANY_MESSAGE
        return None
    if tensor > max(1, gpus):
        return TP_GPUS_MESSAGE
    if ranks > max(1, gpus) and tensor != gpus:
        return STAGE_PER_POD_MESSAGE
    return None


TP_GPUS_MESSAGE = (
    "engine.tensorParallelSize must not exceed the GPUs of one replica "
    "(engine.resources.limits['nvidia.com/gpu'])"
)
STAGE_PER_POD_MESSAGE = (
    "a replica spanning pods runs one pipeline stage per pod: when tensorParallelSize x "
    "pipelineParallelSize exceeds the GPUs of one pod, engine.tensorParallelSize must equal "
    "them (engine.resources.limits['nvidia.com/gpu'])"
)
OURS_ONE_GPU_MESSAGE = (
    "engine.kind servefleet runs one rank per pod: with tensorParallelSize x "
    "pipelineParallelSize > 1 a pod has at most one GPU"
)
OURS_TOO_MANY_MESSAGE = (
    f"engine.kind servefleet: tensorParallelSize x pipelineParallelSize (pods per replica) "
    f"must not exceed {MAX_PODS_PER_REPLICA}"
)
