"""Replicas bigger than one pod against the real LeaderWorkerSet controller (sigs.k8s.io/lws)
and its pod webhook, the API server and the controller-manager (no node: pods are marked
Ready here, standing in for the kubelet).

An LLMDeployment whose replica spans two pods becomes a LeaderWorkerSet; LWS makes each
group's leader and worker pods (labelled, and given the rendezvous env, by its webhook);
the group is what is counted ready and what the scale subresource scales; its pods pass
the API server's `restricted` Pod Security admission.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s.kubectl import Kube, OperatorProcess, wait_for
from k8s.lws import LwsController

from servefleet.api.parallel import LWS_WORKER_INDEX_LABEL
from servefleet.autoscaler.cluster import replica_from_pod

NAME = "grouped"
LWS = f"{NAME}-engine"
PODS = f"servefleet.io/llmdeployment={NAME}"


@pytest.fixture(scope="module")
def lws_controller(
    kube: Kube, k8s_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LwsController | None]:
    if os.environ.get("KUBECONFIG"):  # that cluster's own LWS, installed by its admin
        if "leaderworkersets" not in kube.kubectl("api-resources", "-o", "name"):
            pytest.fail("KUBECONFIG's cluster has no LeaderWorkerSet API: install sigs.k8s.io/lws")
        yield None
        return
    controller = LwsController(k8s_bin, tmp_path_factory.mktemp("lws"), kube)
    try:
        controller.start()
        yield controller
    finally:
        controller.stop()


def _deployment() -> str:
    body = {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"name": NAME, "source": {"builtin": "smollm2-135m-instruct"}},
            # Our engine on CPU: one rank per pod, so a replica of TP 2 is a group of 2 pods.
            "engine": {"tensorParallelSize": 2},
            "pool": {"minReplicas": 1, "maxReplicas": 3},
        },
    }
    return yaml.safe_dump(body)


def _pods(kube: Kube, ns: str) -> dict[str, dict[str, Any]]:
    return {
        p["metadata"]["name"]: p
        for p in kube.list("pods", ns, PODS)
        if not p["metadata"].get("deletionTimestamp")
    }


def _env_names(pod: dict[str, Any]) -> list[str]:
    return [e["name"] for e in pod["spec"]["containers"][0]["env"]]


def _scale(kube: Kube, ns: str) -> dict[str, Any]:
    path = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets/{LWS}/scale"
    result: dict[str, Any] = json.loads(kube.kubectl("get", "--raw", path))
    return result


def _ready(kube: Kube, kind: str, ns: str) -> int:
    return int(((kube.get(kind, LWS, ns) or {}).get("status") or {}).get("readyReplicas", 0))


def _status(kube: Kube, ns: str) -> dict[str, Any]:
    result: dict[str, Any] = (kube.get("llmd", NAME, ns) or {}).get("status", {})
    return result


def test_a_group_of_two_pods_scales_as_one_replica(
    kube: Kube, operator: OperatorProcess, lws_controller: LwsController | None
) -> None:
    ns = "e2e-lws-groups"
    kube.create_namespace(ns)
    # The group's pods, as LWS and its webhook make them, pass the `restricted` standard too.
    kube.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
    kube.apply_text(_deployment(), ns)
    lws = wait_for("the LeaderWorkerSet", lambda: kube.get("leaderworkerset", LWS, ns))
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert kube.get("deployment", LWS, ns) is None

    # LWS's leader StatefulSet makes the leader; LWS makes the leader's worker StatefulSet.
    pods = wait_for("leader and worker", lambda: (p := _pods(kube, ns)) and len(p) == 2 and p)
    leader, worker = pods[f"{LWS}-0"], pods[f"{LWS}-0-1"]
    assert leader["metadata"]["labels"][LWS_WORKER_INDEX_LABEL] == "0"
    assert worker["metadata"]["labels"][LWS_WORKER_INDEX_LABEL] == "1"
    for pod in (leader, worker):
        names = _env_names(pod)
        # LWS's webhook puts its variables first, so the kubelet expands our
        # MASTER_ADDR=$(LWS_LEADER_ADDRESS) and RANK=$(LWS_WORKER_INDEX) from them.
        assert names.index("LWS_LEADER_ADDRESS") < names.index("MASTER_ADDR")
        assert names.index("LWS_WORKER_INDEX") < names.index("RANK")
    service = kube.get("service", LWS, ns)
    assert service is not None and service["spec"]["selector"][LWS_WORKER_INDEX_LABEL] == "0"

    # Readiness is the group's: the leader alone is not a ready replica.
    kube.mark_pods_ready(ns, f"{PODS},{LWS_WORKER_INDEX_LABEL}=0")
    wait_for("the leader StatefulSet sees its pod ready", lambda: _ready(kube, "statefulset", ns))
    assert _ready(kube, "leaderworkerset", ns) == 0
    assert _status(kube, ns).get("readyReplicas", 0) == 0
    kube.mark_pods_ready(ns, PODS)
    wait_for("1 group ready", lambda: _status(kube, ns).get("readyReplicas") == 1, timeout=30)

    # The autoscaler's path: the LLMDeployment's scale subresource, in groups.
    kube.kubectl("scale", f"llmd/{NAME}", "-n", ns, "--replicas=2")
    wait_for("4 pods", lambda: len(_pods(kube, ns)) == 4, timeout=30)
    scale = _scale(kube, ns)
    assert scale["spec"]["replicas"] == 2
    kube.mark_pods_ready(ns, PODS)
    wait_for("2 groups ready", lambda: _status(kube, ns).get("readyReplicas") == 2, timeout=30)
    selector = _status(kube, ns)["selector"]
    assert f"{LWS_WORKER_INDEX_LABEL}=0" in selector.split(",")
    # What the autoscaler observes (pods of status.selector): one replica per group.
    replicas = [replica_from_pod(p) for p in kube.list("pods", ns, selector)]
    assert sorted(r.name for r in replicas if r) == [f"{LWS}-0", f"{LWS}-1"]

    # And back: the whole second group goes, leader and worker.
    kube.kubectl("scale", f"llmd/{NAME}", "-n", ns, "--replicas=1")
    wait_for("group 1 gone", lambda: set(_pods(kube, ns)) == {f"{LWS}-0", f"{LWS}-0-1"},
             timeout=30)  # fmt: skip
    assert _scale(kube, ns)["spec"]["replicas"] == 1
    operator.assert_alive()
