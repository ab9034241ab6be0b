"""Replicas bigger than one pod: the operator renders a LeaderWorkerSet, and the group is
the unit of routing, scraping, scaling, readiness and disruption (`operator.groups`)."""

from __future__ import annotations

from typing import Any

import pytest

from servefleet.api.parallel import LWS_WORKER_INDEX_LABEL
from servefleet.kube.resources import DEPLOYMENTS, LEADER_WORKER_SETS
from servefleet.local.engine_command import LocalModeError, engine_command
from servefleet.operator import render
from servefleet.operator.groups import as_deployment_status, leader_worker_set
from servefleet.operator.pool_cleanup import remove_other_workload
from servefleet.operator.status import Observed, compute_status
from tests.test_operator_reconciler import RecordingClient, reconciler
from tests.test_operator_render import SETTINGS, by_kind, make

URL = {"name": "m", "source": {"url": "https://x/m.gguf"}}
BUILTIN = {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}}
LEADER = "$(LWS_LEADER_ADDRESS)"


def group(kind: str, tp: int, pp: int, gpus: int, **spec: Any) -> Any:
    resources = {"limits": {"nvidia.com/gpu": gpus}} if gpus else {}
    engine = {"kind": kind, "tensorParallelSize": tp, "pipelineParallelSize": pp}
    model = BUILTIN if kind == "servefleet" else URL
    return make({"model": model, "engine": {**engine, "resources": resources}, **spec})


def lws_of(dep: Any) -> dict[str, Any]:
    return by_kind(render.children(dep, SETTINGS, with_service_monitor=True))["LeaderWorkerSet"]


def containers(lws: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    template = lws["spec"]["leaderWorkerTemplate"]
    return (
        template["leaderTemplate"]["spec"]["containers"][0],
        template["workerTemplate"]["spec"]["containers"][0],
    )


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_a_replica_of_several_pods_is_a_leader_worker_set() -> None:
    dep = group("servefleet", 4, 1, 0, replicas=3, pool={"minReplicas": 2, "maxReplicas": 4})
    objs = render.children(dep, SETTINGS, with_service_monitor=True)
    kinds = [o["kind"] for o in objs]
    assert "Deployment" not in kinds and "LeaderWorkerSet" in kinds
    lws = by_kind(objs)["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["name"] == "m1-engine"
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "u"
    spec = lws["spec"]
    assert spec["replicas"] == 3  # groups, not pods
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxUnavailable": 0,
        "maxSurge": 1,
    }
    template = spec["leaderWorkerTemplate"]
    assert template["size"] == 4  # servefleet: one rank per pod
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"


def test_servefleet_ranks_meet_through_torch_env() -> None:
    leader, worker = containers(lws_of(group("servefleet", 2, 1, 0)))
    for container in (leader, worker):
        assert env(container) | {"MASTER_ADDR": LEADER} == env(container)
        assert env(container)["RANK"] == "$(LWS_WORKER_INDEX)"
        assert env(container)["WORLD_SIZE"] == "$(LWS_GROUP_SIZE)"
        assert env(container)["MASTER_PORT"] == "29500"
        args = container["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
        assert args[args.index("--pipeline-parallel-size") + 1] == "1"
    assert "readinessProbe" in leader and "startupProbe" in leader
    # A worker is ready when its group is; it lives through the leader's drain.
    assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(worker)
    assert worker["lifecycle"]["preStop"]["sleep"]["seconds"] == 30


def test_servefleet_tensor_by_pipeline_spans_every_rank() -> None:
    """TP=2 x PP=2: four pods, one rank each, both sizes passed to every rank."""
    lws = lws_of(group("servefleet", 2, 2, 0))
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 4
    for container in containers(lws):
        args = container["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
        assert args[args.index("--pipeline-parallel-size") + 1] == "2"
        assert env(container)["WORLD_SIZE"] == "$(LWS_GROUP_SIZE)"


def test_vllm_follows_its_lws_recipe() -> None:
    leader, worker = containers(lws_of(group("vllm", 8, 2, 8)))
    assert leader["command"][:2] == ["sh", "-c"]
    assert leader["command"][2].startswith("ray start --head --port=6379 && exec")
    serve = leader["command"][4:]
    assert serve[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert serve[serve.index("--tensor-parallel-size") + 1] == "8"
    assert serve[serve.index("--pipeline-parallel-size") + 1] == "2"
    assert serve[serve.index("--distributed-executor-backend") + 1] == "ray"
    assert leader["args"] == []
    assert worker["command"] == [
        "sh",
        "-c",
        'exec ray start --address="$LWS_LEADER_ADDRESS:6379" --block',
    ]
    # Each pod is one pipeline stage: the GPUs of one TP group.
    for c in (leader, worker):
        assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "8"


def test_sglang_nodes_rank_by_worker_index() -> None:
    lws = lws_of(group("sglang", 4, 2, 4))
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    for container in containers(lws):
        args = container["args"]
        assert args[args.index("--tp-size") + 1] == "4"
        assert args[args.index("--pp-size") + 1] == "2"
        assert args[args.index("--nnodes") + 1] == "$(LWS_GROUP_SIZE)"
        assert args[args.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
        assert args[args.index("--dist-init-addr") + 1] == f"{LEADER}:29500"


def test_parallelism_within_one_pod_stays_a_deployment() -> None:
    dep = group("vllm", 4, 2, 8)
    objs = by_kind(render.children(dep, SETTINGS, with_service_monitor=False))
    assert "LeaderWorkerSet" not in objs
    args = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert "--distributed-executor-backend" not in args
    assert LWS_WORKER_INDEX_LABEL not in objs["Service"]["spec"]["selector"]


def test_routing_scraping_and_scaling_see_leaders_only() -> None:
    dep = group("servefleet", 2, 1, 0)
    objs = by_kind(render.children(dep, SETTINGS, with_service_monitor=True))
    assert objs["Service"]["spec"]["selector"][LWS_WORKER_INDEX_LABEL] == "0"
    # status.selector is what the autoscaler lists (and scrapes) replicas with, and the
    # scale subresource's selector: one leader per group, one replica per group.
    selector = render.selector_string(dep)
    assert f"{LWS_WORKER_INDEX_LABEL}=0" in selector.split(",")
    status = compute_status(dep, Observed(None, None), "http://gw/v1", "2026-01-01T00:00:00Z")
    assert status.selector == selector


def test_every_rank_reaches_its_peers_on_any_port() -> None:
    policy = by_kind(render.children(group("sglang", 4, 2, 4), SETTINGS, False))["NetworkPolicy"]
    own = policy["spec"]["podSelector"]
    assert {"from": [{"podSelector": own}]} in policy["spec"]["ingress"]
    single = by_kind(render.children(group("sglang", 4, 1, 4), SETTINGS, False))
    assert len(single["NetworkPolicy"]["spec"]["ingress"]) == 1


@pytest.mark.parametrize(
    ("minimum", "replicas", "budget"),
    [(2, 3, {"maxUnavailable": 1}), (2, 2, {"maxUnavailable": 0}), (0, 3, {"maxUnavailable": 1})],
)
def test_disruptions_are_counted_in_groups(
    minimum: int, replicas: int, budget: dict[str, int]
) -> None:
    pool = {"minReplicas": minimum, "maxReplicas": 4}
    dep = group("servefleet", 2, 1, 0, pool=pool, replicas=replicas)
    pdb = by_kind(render.children(dep, SETTINGS, False))["PodDisruptionBudget"]
    assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == budget


def test_readiness_is_the_groups() -> None:
    dep = group("servefleet", 2, 1, 0, replicas=2, pool={"minReplicas": 2, "maxReplicas": 4})
    lws = lws_of(dep)
    lws["metadata"]["generation"] = 1
    # Three of four pods ready: one group ready (LWS counts a group ready when all are).
    lws["status"] = {
        "replicas": 2,
        "readyReplicas": 1,
        "updatedReplicas": 2,
        "observedGeneration": 1,
    }
    status = compute_status(dep, Observed(as_deployment_status(lws), None), "u", "t")
    assert (status.replicas, status.ready_replicas) == (2, 1)
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "WarmPoolNotReady")
    lws["status"]["readyReplicas"] = 2
    status = compute_status(dep, Observed(as_deployment_status(lws), None), "u", "t")
    assert next(c for c in status.conditions if c.type == "Ready").status == "True"


class GroupClient(RecordingClient):
    def __init__(self, lws_api: bool) -> None:
        super().__init__()
        self.lws_api = lws_api
        self.deleted: list[tuple[str, str]] = []

    async def has_api(self, group_version: str, plural: str) -> bool:
        return self.lws_api and plural == LEADER_WORKER_SETS.plural

    async def delete(self, resource: Any, namespace: str, name: str) -> None:
        self.deleted.append((resource.kind, name))
        self.objects.pop((resource.kind, name), None)


def _grouped() -> Any:
    return group("servefleet", 2, 1, 0)


async def test_without_the_lws_api_nothing_is_applied_and_status_says_why() -> None:
    client = GroupClient(lws_api=False)
    with pytest.raises(Exception, match="need the LeaderWorkerSet API"):
        await reconciler(client, []).reconcile(_grouped())
    assert client.applied == []
    degraded = next(
        c for c in client.status_patches[0]["status"]["conditions"] if c["type"] == "Degraded"
    )
    assert "LeaderWorkerSet API" in degraded["message"]


async def test_switching_to_groups_removes_the_owned_deployment_only() -> None:
    dep = _grouped()
    client = GroupClient(lws_api=True)
    owned = {"metadata": {"name": "m1-engine", "ownerReferences": [{"uid": "u"}]}}
    client.objects[("Deployment", "m1-engine")] = owned
    await reconciler(client, []).reconcile(dep)
    assert client.deleted == [("Deployment", "m1-engine")]
    assert "LeaderWorkerSet" in [o["kind"] for o, _ in client.applied]
    # Someone else's object of that name is left alone; single pods remove an owned LWS.
    client.objects[("Deployment", "m1-engine")] = {"metadata": {"ownerReferences": []}}
    assert await remove_other_workload(client, dep) is None  # type: ignore[arg-type]
    single = make({"model": BUILTIN})
    client.objects[("LeaderWorkerSet", "m1-engine")] = owned
    assert await remove_other_workload(client, single) == "LeaderWorkerSet m1-engine"  # type: ignore[arg-type]
    assert DEPLOYMENTS.kind == "Deployment"


def test_worker_template_is_the_leaders_but_for_serving() -> None:
    dep = group("vllm", 8, 2, 8)
    template = render.engine_pod_template(dep, SETTINGS)
    lws = leader_worker_set(dep, {"name": "x"}, 1, template)
    leader, worker = (
        lws["spec"]["leaderWorkerTemplate"][k]["spec"] for k in ("leaderTemplate", "workerTemplate")
    )
    assert leader["volumes"] == worker["volumes"] == template["spec"]["volumes"]
    assert worker["containers"][0]["image"] == leader["containers"][0]["image"]
    assert template["spec"]["containers"][0]["command"][0] == "python3"  # not mutated


def test_attack_a_group_gains_nothing_a_single_pod_lacks() -> None:
    """Who may set tensor/pipelineParallelSize (a namespace team) gets pods exactly as fenced
    as a one-pod replica's: same securityContext, no API token, no host namespaces, the
    admin's image policy (a refused image renders nothing), and peers only among its own."""
    dep = group("vllm", 8, 2, 8)
    single = render.engine_pod_template(group("vllm", 8, 1, 8), SETTINGS)["spec"]
    lws = lws_of(dep)
    for key in ("leaderTemplate", "workerTemplate"):
        spec = lws["spec"]["leaderWorkerTemplate"][key]["spec"]
        assert spec["securityContext"] == single["securityContext"]
        assert spec["automountServiceAccountToken"] is False
        assert not {"hostNetwork", "hostPID", "hostIPC", "serviceAccountName"} & set(spec)
        container = spec["containers"][0]
        assert container["securityContext"] == single["containers"][0]["securityContext"]
    hostile = group("vllm", 8, 2, 8)
    hostile.spec.engine.image = "evil.example/miner:1"
    assert render.refusal(hostile, SETTINGS) is not None


def test_local_mode_refuses_a_replica_of_several_ranks() -> None:
    with pytest.raises(LocalModeError, match="tensorParallelSize x pipelineParallelSize"):
        engine_command(group("servefleet", 2, 1, 0).spec, "127.0.0.1", 8000)
