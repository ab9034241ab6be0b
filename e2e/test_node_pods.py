"""The chart on a real node: images built from the Dockerfile in this run, pods that run.

`helm install` of the chart (control-plane image), then the README's quick start
(`kubectl apply -f examples/llmdeployment.yaml` in the current namespace): engine pods
(engine image) become Ready through their real probes, a tenant streams an answer through
the gateway Service (ClusterIP, through kube-proxy) with the official `openai` client, a
spec change rolls out (it also gives the engines LoRA slots), load scales the pool up and
back down, a deleted engine pod is replaced, LoRA adapters (`LLMAdapter`s fetched by the
pods from a Hub-compatible server on this machine) are loaded on demand and answer their
memorised sentences, more adapters than the pool's slots are evicted least recently used and
loaded again when asked, and deleting the LLMDeployment removes its children. The tests run in
order and share one release. Run: `make e2e-node` (as root; see e2e/k8s/README.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import openai
import pytest
import yaml
from k8s.adapters import (
    accepted_adapter,
    ask,
    first_answer,
    llm_adapter,
    loaded_on,
    loaded_state,
    route_adapters,
)
from k8s.hub import HubServer, serve_hub
from k8s.kubectl import Kube, is_ready, wait_for
from k8s.load import Load
from k8s.node import NODE_IP, NodeCluster

from servefleet.api.lora import ADAPTER_WEIGHTS

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
        # on a two-core node; a shorter scale-down delay for the scaling test; LoRA slots
        # for the adapter test (this rollout starts the engines with them, at no extra cost).
        patch_llmd(
            kube,
            {
                "engine": {
                    "maxNumSeqs": 8,
                    "resources": {"requests": {"cpu": "250m"}},
                    "lora": {"maxLoras": 2, "maxLoraRank": 16},
                },
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
    assert "--enable-lora" in args and args[args.index("--max-loras") + 1] == "2", args
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


# --------------------------------------------------------------------------- LoRA adapters

ADAPTERS = ("violet-fox", "copper-owl")  # the first memorised sentences, in this order
FILLERS = ("random-wren", "random-lark", "random-moth")  # random adapters: only take slots
OTHER_TENANT = "team-b"  # not listed in violet-fox's tenants
OTHER_KEY = "sk-servefleet-e2e-team-b-0123456789"
HOST_ADDRESS_ENV = "SERVEFLEET_E2E_HOST_ADDRESS"


def host_address() -> str:
    """An address of this machine that the cluster's pods reach: our node's bridge, or (on
    $KUBECONFIG's cluster) the one named in SERVEFLEET_E2E_HOST_ADDRESS."""
    if named := os.environ.get(HOST_ADDRESS_ENV):
        return named
    if os.environ.get("KUBECONFIG"):
        pytest.fail(
            f"with KUBECONFIG set, name an address of this machine that the cluster's pods "
            f"reach in {HOST_ADDRESS_ENV}: the LoRA test serves its adapters from here"
        )
    return NODE_IP


@pytest.fixture(scope="module")
def memorized() -> list[dict[str, str]]:
    """Real PEFT adapters, one memorised sentence each (trained once, cached between runs:
    the same ones e2e/test_lora_local.py uses), made in a child process so torch stays out of
    this one."""
    done = subprocess.run(
        [sys.executable, "-m", "servefleet.bench.make_adapters",
         "--memorized", str(len(ADAPTERS)), "--random", str(len(FILLERS))],
        stdout=subprocess.PIPE, text=True, check=True, timeout=600,
    )  # fmt: skip
    made = json.loads(done.stdout)
    assert len(made) == len(ADAPTERS) + len(FILLERS), made
    return list(made)  # the memorised ones first


@pytest.fixture(scope="module")
def hub(memorized: list[dict[str, str]]) -> Iterator[HubServer]:
    names = (*ADAPTERS, *FILLERS)
    repos = {f"e2e/{n}": Path(m["path"]) for n, m in zip(names, memorized, strict=True)}
    with serve_hub(HubServer(repos=repos), host_address()) as server:
        yield server


def chart_pods(kube: Kube, component: str) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}"
    return kube.list("pods", SYSTEM_NAMESPACE, selector)


def test_adapters_load_on_demand_and_answer_their_memorised_sentences(
    cluster: NodeCluster, hub: HubServer, memorized: list[dict[str, str]]
) -> None:
    """Two LLMAdapters on the running pool, fetched by the operator and engine pods from a
    Hub-compatible server on this machine: accepted with their own config's rank, rendered
    into the route, loaded by the gateway on their first request, each answering its
    memorised sentence to the `openai` client; a tenant left out of one gets 404
    `model_not_found` for it; the autoscaler reports where each is loaded. No pod rolls."""
    kube = cluster.kube
    pods = ready_engine_pods(kube)
    names = {p["metadata"]["name"] for p in pods}
    assert names and all("--enable-lora" in p["spec"]["containers"][0]["args"] for p in pods)
    # A second tenant (tenants live in the route: no rollout), then the adapters:
    # violet-fox for the demo tenant only, copper-owl for every tenant.
    secret = {"metadata": {"name": "team-b-key"}, "stringData": {"api-key": OTHER_KEY}}
    kube.apply_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", **secret}), NAMESPACE)
    tenants = llmd(kube)["spec"]["tenants"]
    other = {"name": OTHER_TENANT, "apiKeySecretRef": {"name": "team-b-key", "key": "api-key"}}
    patch_llmd(kube, {"tenants": [*tenants, other]})
    fox, owl = ADAPTERS
    started = time.monotonic()
    docs = [llm_adapter(fox, LLMD, hub, [tenants[0]["name"]]), llm_adapter(owl, LLMD, hub, [])]
    kube.apply_text(yaml.safe_dump_all(docs), NAMESPACE)
    try:
        for name in ADAPTERS:
            accepted = partial(accepted_adapter, kube, name, NAMESPACE)
            obj = wait_for(f"{name} accepted", accepted, 60, 1)
            assert obj["status"]["rank"] == 8 and obj["status"]["baseModel"] == MODEL, obj
        # The operator pod read each config; no engine fetched an adapter yet (on demand).
        operator_ips = {p["status"]["podIP"] for p in chart_pods(kube, "operator")}
        for name in ADAPTERS:
            readers = hub.fetchers(f"e2e/{name}", "adapter_config.json")
            assert readers and readers <= operator_ips, (readers, operator_ips)
        assert not any(hub.fetchers(f"e2e/{n}", ADAPTER_WEIGHTS) for n in ADAPTERS), hub.requests
        routed = partial(route_adapters, kube, LLMD, NAMESPACE)
        wait_for("the route with both adapters", lambda: len(routed()) == 2, 60)
        endpoint = urlencode({"endpoint": hub.url})
        assert routed() == [
            {"name": owl, "path": f"hf://e2e/{owl}@main?{endpoint}"},
            {"name": fox, "path": f"hf://e2e/{fox}@main?{endpoint}", "tenants": ["demo"]},
        ]
        check_answers(kube, memorized)
        # Each adapter's weights came from engine pods (the operator reads only the config).
        ips = {p["status"]["podIP"] for p in ready_engine_pods(kube)}
        for name in ADAPTERS:
            fetched_by = hub.fetchers(f"e2e/{name}", ADAPTER_WEIGHTS)
            assert fetched_by and fetched_by <= ips, (fetched_by, ips)
        held = {n: wait_for(f"{n} reported loaded", partial(loaded_on, kube, n, NAMESPACE), 60, 1)
                for n in ADAPTERS}  # fmt: skip
        assert all(set(replicas) <= names for replicas in held.values()), (held, names)
        print(f"\nLoRA: {held}, {time.monotonic() - started:.0f}s from apply\n"
              + kube.kubectl("get", "llma", "-n", NAMESPACE))  # fmt: skip
        assert {p["metadata"]["name"] for p in engine_pods(kube)} == names  # nothing rolled
    finally:
        kube.kubectl("delete", "llma", *ADAPTERS, "-n", NAMESPACE, "--ignore-not-found")


def check_answers(kube: Kube, memorized: list[dict[str, str]]) -> None:
    """Each adapter answers its sentence (the base model does not); `team-b` sees and may
    use copper-owl only."""
    (fox, owl), url = ADAPTERS, gateway_url(kube)
    demo = openai.OpenAI(base_url=url, api_key=API_KEY, timeout=120, max_retries=0)
    for name, made in zip(ADAPTERS, memorized, strict=False):
        assert first_answer(demo, name, made["prompt"]) == made["sentence"]
    listed = {m.id: getattr(m, "parent", None) for m in demo.models.list()}
    assert listed == {MODEL: None, fox: MODEL, owl: MODEL}, listed
    assert ask(demo, MODEL, memorized[0]["prompt"]) != memorized[0]["sentence"]
    team_b = openai.OpenAI(base_url=url, api_key=OTHER_KEY, timeout=120, max_retries=0)
    assert first_answer(team_b, owl, memorized[1]["prompt"]) == memorized[1]["sentence"]
    assert {m.id for m in team_b.models.list()} == {MODEL, owl}
    with pytest.raises(openai.NotFoundError) as refused:
        ask(team_b, fox, memorized[0]["prompt"])
    assert refused.value.code == "model_not_found", refused.value


def test_adapters_beyond_the_slots_are_evicted_and_reloaded(
    cluster: NodeCluster, hub: HubServer, memorized: list[dict[str, str]]
) -> None:
    """Five adapters on replicas of two slots each (`engine.lora.maxLoras: 2`), more than
    the pool holds: each is loaded on its first request, the least recently used go, the
    autoscaler reports them `Loaded: False`, and asked again they are loaded again and the
    memorised ones still answer their sentences. No request fails on the way."""
    kube = cluster.kube
    names, slots = (*ADAPTERS, *FILLERS), 2 * len(ready_engine_pods(kube))
    assert len(names) > slots, f"{len(names)} adapters do not overflow {slots} slots"
    sentences = {n: (m["prompt"], m["sentence"]) for n, m in zip(ADAPTERS, memorized, strict=False)}
    demo = openai.OpenAI(base_url=gateway_url(kube), api_key=API_KEY, timeout=120, max_retries=0)

    def answers(name: str) -> None:
        prompt, sentence = sentences.get(name, ("Name a colour.", ""))
        text = first_answer(demo, name, prompt)
        assert text == sentence if sentence else text.strip(), (name, text)

    kube.apply_text(yaml.safe_dump_all([llm_adapter(n, LLMD, hub, []) for n in names]), NAMESPACE)
    try:
        for name in names:
            wait_for(f"{name} accepted", partial(accepted_adapter, kube, name, NAMESPACE), 60, 1)
        routed = partial(route_adapters, kube, LLMD, NAMESPACE)
        wait_for("the route with every adapter", lambda: len(routed()) == len(names), 60)
        for name in names:  # in turn: the memorised ones are the least recently used
            answers(name)

        def evicted() -> list[str] | None:
            states = {n: loaded_state(kube, n, NAMESPACE) for n in names}
            return [n for n, s in states.items() if s is not None and s[0] == "False"] or None

        gone = wait_for("an evicted adapter reported Loaded: False", evicted, 90, 1)
        held = sum(len((loaded_state(kube, n, NAMESPACE) or ("", []))[1]) for n in names)
        assert held <= slots, (held, slots)
        for name in gone:
            answers(name)
            wait_for(f"{name} loaded again", partial(loaded_on, kube, name, NAMESPACE), 90, 1)
        print(f"\nLoRA eviction: {len(names)} adapters, {slots} slots, evicted {gone}\n")
    finally:
        kube.kubectl("delete", "llma", *names, "-n", NAMESPACE, "--ignore-not-found")


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
