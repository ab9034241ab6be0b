"""The chart on a real node: images built from the Dockerfile in this run, pods that run.

`helm install` of the chart (control-plane image), then the README's quick start
(`kubectl apply -f examples/llmdeployment.yaml` in the current namespace): engine pods
(engine image) become Ready through their real probes, a tenant streams an answer through
the gateway Service (ClusterIP, through kube-proxy) with the official `openai` client, a
spec change rolls out, load scales the pool up and back down, a deleted engine pod is
replaced, and deleting the LLMDeployment removes its children. The tests run in order and
share one release. Run: `make e2e-node` (as root; see e2e/k8s/README.md).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from k8s.kubectl import Kube, is_ready, wait_for
from k8s.load import Load
from k8s.node import NodeCluster

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "servefleet"
EXAMPLE = ROOT / "examples" / "llmdeployment.yaml"
RELEASE = "servefleet"
SYSTEM_NAMESPACE = "servefleet"
NAMESPACE = "default"  # the quick start applies the example to the current namespace
LLMD = "smollm2"
MODEL = "smollm2-135m-instruct"  # what tenants ask for: spec.model.name
API_KEY = "sk-servefleet-demo-change-me"  # the example's demo Secret
STARTUP_TIMEOUT_S = 480  # a busy two-core node loads a model slowly
ENGINE_PORT = 8000

pytestmark = pytest.mark.timeout(900)


def split_image(ref: str) -> tuple[str, str]:
    repository, _, tag = ref.rpartition(":")
    return repository, tag


@pytest.fixture(scope="module")
def cluster(node_cluster: NodeCluster) -> NodeCluster:
    """The chart installed with this run's images and its defaults (they fit a two-core node)."""
    repo, tag = split_image(node_cluster.images["control-plane"])
    engine_repo, engine_tag = split_image(node_cluster.images["engine"])
    node_cluster.kube.helm(
        "install", RELEASE, str(CHART), "--namespace", SYSTEM_NAMESPACE, "--create-namespace",
        "--wait", "--timeout=5m",
        "--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
        "--set", f"image.pullPolicy={node_cluster.pull_policy}",
        "--set", f"engineImage.repository={engine_repo}", "--set", f"engineImage.tag={engine_tag}",
        "--set", "operator.resyncSeconds=5",
        "--set", f"operator.watchNamespaces={{{NAMESPACE}}}",
    )  # fmt: skip
    # The README's quick start: the team namespace the example is applied to is watched
    # (by the operator, the gateway and the autoscaler alike; RBAC is bound there).
    return node_cluster


def llmd(kube: Kube) -> dict[str, Any]:
    obj = kube.get("llmd", LLMD, NAMESPACE)
    assert obj is not None
    return obj


def engine_pods(kube: Kube) -> list[dict[str, Any]]:
    selector = llmd(kube).get("status", {}).get("selector")
    if not selector:
        return []
    pods = kube.list("pods", NAMESPACE, selector)
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def ready_engine_pods(kube: Kube) -> list[dict[str, Any]]:
    return [p for p in engine_pods(kube) if is_ready(p)]


def gateway_url(kube: Kube) -> str:
    service = kube.get("service", f"{RELEASE}-gateway", SYSTEM_NAMESPACE)
    assert service is not None
    port = service["spec"]["ports"][0]["port"]
    return f"http://{service['spec']['clusterIP']}:{port}/v1"


def patch_llmd(kube: Kube, spec: dict[str, Any]) -> None:
    kube.kubectl(
        "patch", "llmd", LLMD, "-n", NAMESPACE, "--type=merge", "-p", json.dumps({"spec": spec})
    )


def wait_ready_count(kube: Kube, count: int, timeout: float = STARTUP_TIMEOUT_S) -> None:
    wait_for(
        f"{count} ready engine pod(s)",
        lambda: len(ready_engine_pods(kube)) == count and len(engine_pods(kube)) == count,
        timeout=timeout,
        interval=2,
    )


def assert_all_answered(load: Load) -> None:
    assert load.outcomes["200"] > 0, load.outcomes
    assert load.outcomes["failed"] == 0, (load.outcomes, load.failures[:5])


def test_example_engine_pods_become_ready_through_their_probes(cluster: NodeCluster) -> None:
    kube = cluster.kube
    kube.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLE))
    wait_ready_count(kube, 1)
    pod = ready_engine_pods(kube)[0]
    status = pod["status"]["containerStatuses"][0]
    assert status["ready"] and "running" in status["state"], status
    assert pod["spec"]["nodeName"], pod["spec"]
    assert pod["spec"]["containers"][0]["image"] == cluster.images["engine"]
    shown = kube.kubectl("get", "llmd", "-n", NAMESPACE)
    assert LLMD in shown and "smollm2-135m-instruct" in shown, shown
    wait_for(
        "status.readyReplicas of the LLMDeployment",
        lambda: llmd(kube).get("status", {}).get("readyReplicas") == 1,
        timeout=60,
    )


def test_tenant_streams_an_answer_through_the_gateway_service(cluster: NodeCluster) -> None:
    client = openai.OpenAI(
        base_url=gateway_url(cluster.kube), api_key=API_KEY, timeout=60, max_retries=0
    )
    errors: list[str] = []

    def stream() -> str | None:
        try:
            chunks = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=16,
                stream=True,
            )
            parts, finish = [], None
            for chunk in chunks:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
        except (openai.NotFoundError, openai.APIConnectionError, openai.InternalServerError) as exc:
            errors.append(repr(exc))  # the gateway has not read the route or endpoints yet
            return None
        assert finish in ("stop", "length"), finish
        return "".join(parts)

    try:
        text = wait_for("a streamed answer through the gateway Service", stream, timeout=90)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last errors: {errors[-3:]}") from None
    assert text.strip()


def test_spec_change_rolls_out_without_a_failed_request(cluster: NodeCluster) -> None:
    kube = cluster.kube
    old_pod = ready_engine_pods(kube)[0]["metadata"]["name"]
    load = Load(gateway_url(kube), API_KEY, MODEL, concurrency=2).start()
    try:
        # New maxNumSeqs, and a smaller CPU request so the next tests fit three engines
        # on a two-core node; a shorter scale-down delay for the scaling test.
        patch_llmd(
            kube,
            {
                "engine": {"maxNumSeqs": 8, "resources": {"requests": {"cpu": "250m"}}},
                "pool": {"scaleDownDelay": 10},
            },
        )
        lowest_ready = 1

        def rolled_out() -> bool:
            nonlocal lowest_ready
            ready = ready_engine_pods(kube)
            lowest_ready = min(lowest_ready, len(ready))
            names = {p["metadata"]["name"] for p in engine_pods(kube)}
            return bool(ready) and old_pod not in names and len(names) == 1

        wait_for("the rollout to replace the engine pod", rolled_out, STARTUP_TIMEOUT_S, 1)
    finally:
        load.stop()
    assert lowest_ready >= 1, "ready engines dropped below the warm minimum"
    args = ready_engine_pods(kube)[0]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "8", args
    assert_all_answered(load)


def requests_seen(pod: dict[str, Any]) -> float:
    """Requests an engine pod has finished or is running, from its own /metrics."""
    url = f"http://{pod['status']['podIP']}:{ENGINE_PORT}/metrics"
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return 0.0
    names = ("servefleet_engine_requests_finished_total", "vllm:num_requests_running")
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(names)
    )


def test_load_scales_the_pool_up_and_back_down(cluster: NodeCluster) -> None:
    kube = cluster.kube
    first = {p["metadata"]["name"] for p in engine_pods(kube)}
    load = Load(gateway_url(kube), API_KEY, MODEL, concurrency=20, max_tokens=16).start()
    try:
        added = wait_for(
            "the autoscaler to add a ready engine",
            lambda: [p for p in ready_engine_pods(kube) if p["metadata"]["name"] not in first],
            timeout=STARTUP_TIMEOUT_S,
            interval=2,
        )
        wait_for(
            "the added engine to receive traffic",
            lambda: all(requests_seen(pod) > 0 for pod in added),
            timeout=120,
            interval=2,
        )
    finally:
        load.stop()
    assert_all_answered(load)
    # A trickle while the pool shrinks: the victim drains, so no stream is cut.
    trickle = Load(gateway_url(kube), API_KEY, MODEL, concurrency=1).start()
    try:
        wait_for(
            "the pool to scale back to its minimum",
            lambda: len(engine_pods(kube)) == 1 and len(ready_engine_pods(kube)) == 1,
            timeout=240,
            interval=2,
        )
    finally:
        trickle.stop()
    assert_all_answered(trickle)


def test_deleted_engine_pod_is_replaced_without_a_hang(cluster: NodeCluster) -> None:
    kube = cluster.kube
    patch_llmd(kube, {"pool": {"minReplicas": 2}})
    wait_ready_count(kube, 2)
    load = Load(gateway_url(kube), API_KEY, MODEL, concurrency=4).start()
    try:
        time.sleep(5)
        victim = ready_engine_pods(kube)[0]["metadata"]["name"]
        kube.kubectl("delete", "pod", victim, "-n", NAMESPACE, "--wait=false")
        wait_for(
            "a replacement engine pod to become ready",
            lambda: (
                len(ready_engine_pods(kube)) == 2
                and victim not in {p["metadata"]["name"] for p in engine_pods(kube)}
            ),
            timeout=STARTUP_TIMEOUT_S,
            interval=2,
        )
    finally:
        load.stop()
    assert_all_answered(load)
    assert load.slowest_s < 45, f"a request took {load.slowest_s:.0f}s"


def test_deleting_the_llmdeployment_removes_every_child(cluster: NodeCluster) -> None:
    kube = cluster.kube
    uid = llmd(kube)["metadata"]["uid"]
    kube.kubectl("delete", "llmd", LLMD, "-n", NAMESPACE, "--wait=true", "--timeout=120s")

    def children_left() -> list[str]:
        left = []
        for kind in ("deployments", "replicasets", "pods", "services", "configmaps", "pdb"):
            for obj in kube.list(kind, NAMESPACE):
                owners = obj["metadata"].get("ownerReferences", [])
                labels = obj["metadata"].get("labels", {})
                if any(o.get("uid") == uid for o in owners) or (
                    labels.get("app.kubernetes.io/instance") == LLMD
                ):
                    left.append(f"{kind}/{obj['metadata']['name']}")
        return left

    wait_for("every child to be gone", lambda: not children_left() or None, timeout=180)
