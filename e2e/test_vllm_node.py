"""`engine.kind: vllm` on the real node: vLLM's CPU build run by the operator as it renders it.

The chart with this run's images, then an LLMDeployment with engine.kind vllm whose engine
image is vLLM's CPU build (`k8s/vllm/Dockerfile`, built by `k8s/images_vllm.sh`) and whose
model is a PersistentVolumeClaim holding the built-in model as a Hugging Face folder (converted
from its GGUF when the image was built) and a LoRA adapter (made by
`servefleet.bench.make_adapters`). In order, sharing one release and one deployment: the pod
becomes Ready through its real probes; a tenant streams an answer through the gateway Service
with the official `openai` client; the autoscaler reads vLLM's own series and scales the pool
up under load and back down; a replica stopped mid-stream (SIGTERM, as on scale-down) drains
it; an `LLMAdapter` on the claim is loaded by the gateway through vLLM's
`/v1/load_lora_adapter` and answers its memorised sentence.

Not part of `make e2e-node` (the image is large and slow to build): `make e2e-vllm`, as root.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from k8s.host_volume import bind_host_folder
from k8s.kubectl import Kube, condition, is_ready, wait_for
from k8s.load import Load
from k8s.node import NodeCluster

from servefleet.api.conventions import (
    ENGINE_KEY_SECRET_KEY,
    ROUTE_GATEWAY_KEY,
    engine_key_secret_name,
    route_object_name,
)
from servefleet.api.engines import ENGINE_ADAPTERS
from servefleet.autoscaler.engine_metrics import parse_engine_load

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "servefleet"
IMAGES_VLLM = ROOT / "e2e" / "k8s" / "images_vllm.sh"
RELEASE = "servefleet"
SYSTEM_NAMESPACE = "servefleet"
NAMESPACE = "vllm-e2e"
LLMD = "smollm2-vllm"
MODEL = "smollm2-135m-instruct"
MODEL_FOLDER = "smollm2-135m-instruct"  # inside the claim
CLAIM = "models"
ADAPTER = "violet-fox"  # make_adapters' first memorised sentence
API_KEY = "sk-servefleet-e2e-vllm-0123456789"
STARTUP_TIMEOUT_S = 900  # vLLM imports torch in three processes; a busy two-core node is slow
ENGINE = ENGINE_ADAPTERS["vllm"]

pytestmark = pytest.mark.timeout(3600)


def split_image(ref: str) -> tuple[str, str]:
    repository, _, tag = ref.rpartition(":")
    return repository, tag


@pytest.fixture(scope="module")
def vllm_image(node_cluster: NodeCluster) -> dict[str, str]:
    """`engine-vllm` (reference) and `vllm-model` (the model folder, copied out of it)."""
    if os.environ.get("KUBECONFIG") or node_cluster.containerd_socket is None:
        pytest.skip(
            "needs this suite's own node: the model and adapter volume is a folder of this "
            "machine, and the vLLM image is imported into the node's containerd"
        )
    started = time.monotonic()
    done = subprocess.run(
        ["bash", str(IMAGES_VLLM), str(node_cluster.containerd_socket)],
        stdout=subprocess.PIPE, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail("e2e/k8s/images_vllm.sh failed (its output is above)")
    found = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    print(f"\nvLLM image {found['engine-vllm']} ready in {time.monotonic() - started:.0f}s")
    return found


@pytest.fixture(scope="module")
def memorized() -> dict[str, str]:
    """A real PEFT adapter with one memorised sentence (cached between runs; the one
    e2e/test_lora_local.py uses first), made in a child process so torch stays out of this one."""
    done = subprocess.run(
        [sys.executable, "-m", "servefleet.bench.make_adapters", "--memorized", "1",
         "--random", "0"],
        stdout=subprocess.PIPE, text=True, check=True, timeout=900,
    )  # fmt: skip
    made: list[dict[str, str]] = json.loads(done.stdout)
    return made[0]


@pytest.fixture(scope="module")
def models_folder(
    vllm_image: dict[str, str], memorized: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """What the claim holds: the model folder and the adapter, readable by the engine user."""
    folder = tmp_path_factory.mktemp("vllm-models")
    shutil.copytree(vllm_image["vllm-model"], folder / MODEL_FOLDER)
    shutil.copytree(memorized["path"], folder / "adapters" / ADAPTER)
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


@pytest.fixture(scope="module")
def cluster(node_cluster: NodeCluster, vllm_image: dict[str, str], models_folder: Path) -> Kube:
    """The chart (its engine-image allow-list naming the vLLM image), the claim, a tenant."""
    kube = node_cluster.kube
    repo, tag = split_image(node_cluster.images["control-plane"])
    vllm_repo, _ = split_image(vllm_image["engine-vllm"])
    kube.kubectl("create", "namespace", NAMESPACE, check=False)  # watched: bound at install
    kube.helm(
        "upgrade", "--install", RELEASE, str(CHART), "--namespace", SYSTEM_NAMESPACE,
        "--create-namespace", "--wait", "--timeout=5m",
        "--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
        "--set", f"image.pullPolicy={node_cluster.pull_policy}",
        "--set", f"operator.allowedImages={{{vllm_repo}}}",
        "--set", "operator.resyncSeconds=5",
        "--set", f"operator.watchNamespaces={{{NAMESPACE}}}",
    )  # fmt: skip
    bind_host_folder(kube, NAMESPACE, CLAIM, models_folder, "2Gi")
    secret = {"metadata": {"name": "demo-key"}, "stringData": {"api-key": API_KEY}}
    kube.apply_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", **secret}), NAMESPACE)
    return kube


def llm_deployment(image: str) -> dict[str, Any]:
    """vLLM's CPU build wants a KV-cache size (else it reserves 92% of the node's memory), a
    block size that is a multiple of 32, and float32 here (its bfloat16 kernels die of SIGILL
    on CPUs whose AMX faults); every other knob is the deployment's usual."""
    return {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": LLMD},
        "spec": {
            "model": {
                "name": MODEL,
                "source": {"pvc": {"claimName": CLAIM, "path": MODEL_FOLDER}},
            },
            "engine": {
                "kind": "vllm",
                "image": image,
                "blockSize": 32,
                "dtype": "float32",
                "kvCacheMemory": "512Mi",
                "maxNumSeqs": 8,
                "drainTimeoutSeconds": 60,
                "startupTimeoutSeconds": STARTUP_TIMEOUT_S,
                "lora": {"maxLoras": 2, "maxLoraRank": 8},
                "resources": {
                    "requests": {"cpu": "250m", "memory": "1Gi"},
                    "limits": {"memory": "6Gi"},
                },
            },
            "pool": {
                "minReplicas": 1,
                "maxReplicas": 2,
                "scaleDownDelay": 10,
                "perReplicaConcurrency": 4,
            },
            "autoscaling": {"targetPerReplica": 2, "queueWaitTarget": 2, "interval": 2},
            "admission": {"maxQueueDepth": 64, "maxQueueWait": 60},
            "tenants": [
                {
                    "name": "demo",
                    "apiKeySecretRef": {"name": "demo-key", "key": "api-key"},
                    "trafficClass": "interactive",
                }
            ],
        },
    }


# --------------------------------------------------------------------------- helpers


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


def wait_ready_count(kube: Kube, count: int, timeout: float = STARTUP_TIMEOUT_S) -> None:
    wait_for(
        f"{count} ready vLLM engine pod(s)",
        lambda: len(ready_engine_pods(kube)) == count and len(engine_pods(kube)) == count,
        timeout=timeout,
        interval=2,
    )


def gateway_url(kube: Kube) -> str:
    service = kube.get("service", f"{RELEASE}-gateway", SYSTEM_NAMESPACE)
    assert service is not None
    port = service["spec"]["ports"][0]["port"]
    return f"http://{service['spec']['clusterIP']}:{port}/v1"


def client(kube: Kube, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway_url(kube), api_key=API_KEY, timeout=timeout,
                         max_retries=0)  # fmt: skip


def pod_url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:{ENGINE.port}"


def metrics_text(pod: dict[str, Any]) -> str:
    """A replica's own /metrics (open to the node, as to the autoscaler's pod)."""
    return httpx.get(pod_url(pod) + ENGINE.metrics_path, timeout=10).text


def requests_seen(pod: dict[str, Any]) -> float:
    """Requests a vLLM replica finished or is running, from its own series."""
    try:
        text = metrics_text(pod)
    except httpx.HTTPError:
        return 0.0
    names = ("vllm:request_success_total", ENGINE.metrics.requests_running)
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(names)
    )


def assert_all_answered(load: Load) -> None:
    assert load.outcomes["200"] > 0, load.outcomes
    assert load.outcomes["failed"] == 0, (load.outcomes, load.failures[:5])


def engine_key(kube: Kube) -> str:
    secret = kube.get("secret", engine_key_secret_name(LLMD), NAMESPACE)
    assert secret is not None
    return base64.b64decode(secret["data"][ENGINE_KEY_SECRET_KEY]).decode()


def chart_pods(kube: Kube, component: str) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}"
    return [p for p in kube.list("pods", SYSTEM_NAMESPACE, selector) if is_ready(p)]


# Run inside the autoscaler's pod: its own code reads a replica's series, over its own path
# to the engine pods (the NetworkPolicy admits it).
AUTOSCALER_READ = """
import sys, httpx
from servefleet.autoscaler.engine_metrics import parse_engine_load
text = httpx.get(sys.argv[1], timeout=10).text
print(parse_engine_load(text, "vllm", sys.argv[2]).model_dump_json())
"""


def read_by_autoscaler(kube: Kube, pod: dict[str, Any]) -> dict[str, Any]:
    """A replica's load as the autoscaler pod reads it (`engine_metrics`, vLLM's names)."""
    autoscaler = chart_pods(kube, "autoscaler")[0]["metadata"]["name"]
    out = kube.kubectl(
        "exec", "-n", SYSTEM_NAMESPACE, autoscaler, "--", "python", "-c", AUTOSCALER_READ,
        pod_url(pod) + ENGINE.metrics_path, MODEL,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def continuations(kube: Kube) -> float:
    """Streams the gateways continued on another replica (`servefleet_gateway_`), summed."""
    key = kube.get("secret", f"{RELEASE}-internal", SYSTEM_NAMESPACE)
    assert key is not None
    token = base64.b64decode(key["data"]["internal-api-key"]).decode()
    service = kube.get("service", f"{RELEASE}-gateway", SYSTEM_NAMESPACE)
    assert service is not None
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "internal")
    total = 0.0
    for pod in chart_pods(kube, "gateway"):
        url = f"http://{pod['status']['podIP']}:{port}/metrics"
        text = httpx.get(url, headers={"authorization": f"Bearer {token}"}, timeout=10).text
        total += sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("servefleet_gateway_stream_continuations_total")
        )
    return total


def pod_log_tail(kube: Kube, lines: int = 30) -> str:
    pods = engine_pods(kube)
    if not pods:
        return "(no engine pod)"
    name = pods[0]["metadata"]["name"]
    return kube.kubectl("logs", name, "-n", NAMESPACE, f"--tail={lines}", check=False)


# --------------------------------------------------------------------------- tests


def test_vllm_pod_becomes_ready_through_its_probes(
    cluster: Kube, vllm_image: dict[str, str]
) -> None:
    kube = cluster
    kube.apply_text(yaml.safe_dump(llm_deployment(vllm_image["engine-vllm"])), NAMESPACE)
    started = time.monotonic()
    try:
        wait_ready_count(kube, 1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nengine log:\n{pod_log_tail(kube)}") from None
    print(f"\nvLLM pod ready {time.monotonic() - started:.0f}s after apply")
    pod = ready_engine_pods(kube)[0]
    container = pod["spec"]["containers"][0]
    assert container["image"] == vllm_image["engine-vllm"]
    assert container["command"] == list(ENGINE.command)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", container[probe]
    args = container["args"]
    assert args[args.index("--model") + 1] == f"/models/{MODEL_FOLDER}", args
    assert "--enable-lora" in args and args[args.index("--shutdown-timeout") + 1] == "60", args
    env = {var["name"]: var.get("value") for var in container["env"]}
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True", env
    wait_for(
        "status.readyReplicas of the LLMDeployment",
        lambda: llmd(kube).get("status", {}).get("readyReplicas") == 1,
        timeout=60,
    )


def test_tenant_streams_an_answer_through_the_gateway(cluster: Kube) -> None:
    errors: list[str] = []

    def stream() -> str | None:
        try:
            chunks = client(cluster, 60).chat.completions.create(
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
        text = wait_for("a streamed answer through the gateway Service", stream, 120, 2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last errors: {errors[-3:]}") from None
    assert text.strip()
    assert {m.id for m in client(cluster).models.list()} == {MODEL}


def test_autoscaler_scales_on_vllm_metrics_up_and_back_down(cluster: Kube) -> None:
    """The series the autoscaler reads (`engine_metrics`, names from the engine table) are
    vLLM's own; under load the pool grows by a replica that serves, and shrinks back to its
    minimum under a trickle without a failed request."""
    kube = cluster
    first = {p["metadata"]["name"] for p in engine_pods(kube)}
    idle = parse_engine_load(metrics_text(ready_engine_pods(kube)[0]), "vllm", MODEL)
    assert (idle.waiting, idle.running) == (0, 0), idle
    load = Load(gateway_url(kube), API_KEY, MODEL, concurrency=8, max_tokens=24).start()
    try:
        busy = wait_for(
            "vLLM's own series to show requests running",
            lambda: [
                read for pod in ready_engine_pods(kube)
                if (read := parse_engine_load(metrics_text(pod), "vllm", MODEL)).running > 0
            ],
            timeout=120, interval=1,
        )  # fmt: skip
        seen = wait_for(
            "the autoscaler's pod to read requests running from vLLM's series",
            lambda: [
                read for pod in ready_engine_pods(kube)
                if (read := read_by_autoscaler(kube, pod))["running"] > 0
            ],
            timeout=120, interval=1,
        )  # fmt: skip
        print(f"\nvLLM load read here {busy}, in the autoscaler's pod {seen}")
        added = wait_for(
            "the autoscaler to add a ready vLLM engine",
            lambda: [p for p in ready_engine_pods(kube) if p["metadata"]["name"] not in first],
            timeout=STARTUP_TIMEOUT_S,
            interval=2,
        )
        wait_for(
            "the added engine to receive traffic",
            lambda: all(requests_seen(pod) > 0 for pod in added),
            timeout=180,
            interval=2,
        )
    finally:
        load.stop()
    assert_all_answered(load)
    events = kube.kubectl("get", "events", "-n", NAMESPACE, "--field-selector",
                          f"involvedObject.name={LLMD}", "-o", "json")  # fmt: skip
    reasons = [e.get("message", "") for e in json.loads(events)["items"]]
    print("autoscaler events:\n  " + "\n  ".join(reasons))
    trickle = Load(gateway_url(kube), API_KEY, MODEL, concurrency=1).start()
    try:
        wait_for(
            "the pool to scale back to its minimum",
            lambda: len(engine_pods(kube)) == 1 and len(ready_engine_pods(kube)) == 1,
            timeout=300,
            interval=2,
        )
    finally:
        trickle.stop()
    assert_all_answered(trickle)


def test_a_stopped_replica_finishes_its_streams(cluster: Kube) -> None:
    """SIGTERM (what scale-down and a deleted pod send) lets the in-flight stream end
    normally: vLLM waits --shutdown-timeout (the spec's drainTimeoutSeconds) before it exits."""
    kube = cluster
    wait_ready_count(kube, 1)
    victim = ready_engine_pods(kube)[0]
    outcome: dict[str, Any] = {}

    def stream() -> None:
        parts: list[str] = []
        try:
            chunks = client(kube, 300).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Count from one to two hundred."}],
                max_tokens=160,
                temperature=0,
                stream=True,
            )
            for chunk in chunks:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    outcome["finish"] = chunk.choices[0].finish_reason or outcome.get("finish")
        except openai.OpenAIError as exc:
            outcome["error"] = repr(exc)
        outcome["chunks"] = len(parts)

    continued_before = continuations(kube)
    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    wait_for("the stream to be running on the replica",
             lambda: parse_engine_load(metrics_text(victim), "vllm", MODEL).running == 1,
             timeout=60, interval=0.2)  # fmt: skip
    deleted = time.monotonic()
    kube.kubectl("delete", "pod", victim["metadata"]["name"], "-n", NAMESPACE, "--wait=false")
    thread.join(timeout=300)
    print(f"\nstream after SIGTERM: {outcome}, {time.monotonic() - deleted:.0f}s after delete")
    assert "error" not in outcome, outcome
    assert outcome.get("finish") in ("stop", "length") and outcome["chunks"] > 20, outcome
    # Served whole by the stopped replica: the gateway continued no stream elsewhere.
    assert continuations(kube) == continued_before
    wait_ready_count(kube, 1)


def test_adapter_is_loaded_by_the_gateway_through_vllm_s_endpoint(
    cluster: Kube, memorized: dict[str, str]
) -> None:
    """An LLMAdapter on the deployment's claim: accepted (its config is the engine's to check),
    in the route as the folder the pods mount, loaded by the gateway on its first request
    (nothing else calls vLLM's load endpoint here) and answering its memorised sentence."""
    kube = cluster
    pods = {p["metadata"]["name"] for p in ready_engine_pods(kube)}
    adapter = {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMAdapter",
        "metadata": {"name": ADAPTER},
        "spec": {"deployment": LLMD, "source": {"pvc": {"claimName": CLAIM,
                                                        "path": f"adapters/{ADAPTER}"}}},
    }  # fmt: skip
    kube.apply_text(yaml.safe_dump(adapter), NAMESPACE)

    def accepted() -> dict[str, Any] | None:
        found = condition(kube.get("llma", ADAPTER, NAMESPACE), "Accepted")
        if found is not None and found["status"] == "False":
            raise AssertionError(f"{ADAPTER} refused: {found}")
        return found if found is not None and found["status"] == "True" else None

    wait_for(f"{ADAPTER} accepted", accepted, 60, 1)

    def route_paths() -> list[str] | None:
        route = kube.get("configmap", route_object_name(LLMD), NAMESPACE)
        if route is None:
            return None
        config = yaml.safe_load(route["data"][ROUTE_GATEWAY_KEY])
        return [a["path"] for d in config["deployments"] for a in d.get("adapters", [])] or None

    paths = wait_for("the adapter in the route", route_paths, 60, 1)
    assert paths == [f"/models/adapters/{ADAPTER}"], paths
    demo = client(kube)
    errors: list[str] = []

    def answer() -> str | None:
        try:
            reply = demo.chat.completions.create(
                model=ADAPTER,
                messages=[{"role": "user", "content": memorized["prompt"]}],
                max_tokens=24,
                temperature=0,
            )
        except (openai.NotFoundError, openai.AuthenticationError) as exc:
            errors.append(repr(exc))  # the gateway reads the new route within seconds
            return None
        assert reply.model == ADAPTER, reply.model
        return reply.choices[0].message.content or ""

    try:
        text = wait_for(f"an answer from {ADAPTER} through the gateway", answer, 180, 1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last errors: {errors[-3:]}") from None
    assert text == memorized["sentence"], text
    base = demo.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": memorized["prompt"]}],
        max_tokens=24, temperature=0,
    )  # fmt: skip
    assert base.choices[0].message.content != memorized["sentence"]
    listed = {m.id: getattr(m, "parent", None) for m in demo.models.list()}
    assert listed == {MODEL: None, ADAPTER: MODEL}, listed
    # vLLM itself holds it, from the folder the route names (the gateway's load did that).
    headers = {"Authorization": f"Bearer {engine_key(kube)}"}
    held = {}
    for pod in ready_engine_pods(kube):
        cards = httpx.get(pod_url(pod) + "/v1/models", headers=headers, timeout=10).json()
        held.update({c["id"]: (c.get("parent"), c.get("root")) for c in cards["data"]})
    assert held[ADAPTER] == (MODEL, f"/models/adapters/{ADAPTER}"), held
    assert {p["metadata"]["name"] for p in ready_engine_pods(kube)} == pods  # nothing rolled
