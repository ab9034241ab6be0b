"""The operator against a real API server, controller-manager and the chart's RBAC."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import RELEASE, SYSTEM_NAMESPACE
from k8s.kubectl import Kube, OperatorProcess, condition, is_ready, wait_for

from servefleet.api.conventions import (
    COMPONENT_ENGINE,
    FIELD_MANAGER_OPERATOR,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    ROUTE_GATEWAY_KEY,
)
from servefleet.api.gateway_config import GatewayConfig
from servefleet.api.gateway_stats import DeploymentStats
from servefleet.autoscaler.actuate import KubernetesActuator
from servefleet.autoscaler.cluster import ClusterAutoscaler
from servefleet.autoscaler.explain import Reason
from servefleet.autoscaler.gateway_fleet import GatewayFleetSource
from servefleet.autoscaler.policy import Decision, PolicyState
from servefleet.autoscaler.signals import Observation, ReplicaLoad, ReplicaState
from servefleet.autoscaler.telemetry import AutoscalerMetrics
from servefleet.kube import KubeAccess

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llmdeployment.yaml"
ENGINE = f"{LABEL_COMPONENT}={COMPONENT_ENGINE}"
CHILD_KINDS = [
    "configmap",
    "service",
    "deployment",
    "poddisruptionbudget",
    "networkpolicy",
    "servicemonitor",
]
VLLM_ON_URL = {"name": "m", "source": {"url": "https://models.example/m"}}


def llmd(name: str, **spec: Any) -> str:
    body: dict[str, Any] = {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"name": name, "source": {"builtin": "smollm2-135m-instruct"}}, **spec},
    }
    return yaml.safe_dump(body)


def selector(name: str) -> str:
    return f"{LABEL_DEPLOYMENT}={name},{ENGINE}"


def status(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    obj = kube.get("llmd", name, ns)
    assert obj is not None
    result: dict[str, Any] = obj.get("status", {})
    return result


def pool_state(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    """What a failed wait on a pool reports: its status, its Deployment's, its pods'."""
    deployment = kube.get("deployment", f"{name}-engine", ns) or {}
    pods = {p["metadata"]["name"]: is_ready(p) for p in kube.list("pods", ns, selector(name))}
    return {
        "llmd": {k: v for k, v in status(kube, ns, name).items() if "eplicas" in k},
        "deployment": {"spec": deployment.get("spec", {}).get("replicas"),
                       "status": deployment.get("status")},
        "pods ready": pods,
    }  # fmt: skip


def reconciled(obj: dict[str, Any] | None) -> bool:
    """Status written for the object's current spec (the operator's first pass also sets an
    unset spec.replicas through the scale subresource, which is a second generation)."""
    if obj is None:
        return False
    observed = obj.get("status", {}).get("observedGeneration")
    return observed is not None and observed == obj["metadata"]["generation"]


def ready_pods(kube: Kube, ns: str, name: str) -> int:
    return sum(
        1
        for p in kube.list("pods", ns, selector(name))
        if is_ready(p) and not p["metadata"].get("deletionTimestamp")
    )


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> str:
    name = "e2e-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].strip("-")
    kube.create_namespace(name)
    return name


def test_chart_lints_and_renders(kube: Kube, rendered_chart: Path) -> None:
    lint = kube.helm("lint", str(ROOT / "charts" / "servefleet"), "--strict")
    assert "0 chart(s) failed" in lint
    kinds = {
        (d["kind"], d["metadata"]["name"])
        for d in yaml.safe_load_all(rendered_chart.read_text())
        if d
    }
    for expected in [
        ("CustomResourceDefinition", "llmdeployments.servefleet.io"),
        ("CustomResourceDefinition", "llmadapters.servefleet.io"),
        ("Deployment", "servefleet-operator"),
        ("Deployment", "servefleet-gateway"),
        ("Service", "servefleet-gateway"),
        ("Deployment", "servefleet-autoscaler"),
        ("Deployment", "servefleet-redis"),
        ("ClusterRole", "servefleet-operator"),
        ("ServiceMonitor", "servefleet-gateway"),
        ("ConfigMap", "servefleet-dashboard-servefleet-overview"),
    ]:
        assert expected in kinds
    operator = next(
        d
        for d in yaml.safe_load_all(rendered_chart.read_text())
        if d and d["metadata"]["name"] == "servefleet-operator" and d["kind"] == "Deployment"
    )
    gateway_cm = next(
        d
        for d in yaml.safe_load_all(rendered_chart.read_text())
        if d and d["kind"] == "ConfigMap" and d["metadata"]["name"] == "servefleet-gateway"
    )
    base = GatewayConfig.model_validate(yaml.safe_load(gateway_cm["data"]["gateway.yaml"]))
    assert base.redis is not None and base.redis.url.startswith("redis://servefleet-redis.")
    version = next(
        line.split('"')[1]
        for line in (ROOT / "pyproject.toml").read_text().splitlines()
        if line.startswith("version")
    )
    assert operator["spec"]["template"]["spec"]["containers"][0]["image"].endswith(f":{version}")


def test_rendered_chart_is_accepted_by_the_api_server(kube: Kube, installed_chart: Path) -> None:
    # Applied for real by the fixture; a server-side dry run re-validates every object.
    out = kube.kubectl(
        "apply",
        "--server-side",
        "--field-manager=helm",
        "--dry-run=server",
        "-f",
        str(installed_chart),
    )
    assert "servefleet-operator" in out
    assert kube.get("deployment", "servefleet-gateway", "servefleet") is not None
    # The published OpenAPI of a new CRD trails its Established condition a little.
    explain = wait_for(
        "kubectl explain", lambda: kube.kubectl("explain", "llmd.spec.pool.minReplicas")
    )
    assert "The warm pool" in explain


def test_example_reconciles_children_status_and_columns(
    kube: Kube, operator: OperatorProcess, namespace: str
) -> None:
    kube.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))
    for kind in CHILD_KINDS:
        name = "smollm2-gateway-route" if kind == "configmap" else "smollm2-engine"
        wait_for(f"{kind} {name}", lambda k=kind, n=name: kube.get(k, n, namespace), timeout=60)
    owner = kube.get("llmd", "smollm2", namespace)
    assert owner is not None
    deployment = kube.get("deployment", "smollm2-engine", namespace)
    assert deployment is not None
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "servefleet:e2e"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    managed = json.loads(
        kube.kubectl(
            "get",
            "deployment",
            "smollm2-engine",
            "-n",
            namespace,
            "-o",
            "json",
            "--show-managed-fields",
        )
    )["metadata"]["managedFields"]
    managers = {m["manager"] for m in managed if m["operation"] == "Apply"}
    assert managers == {FIELD_MANAGER_OPERATOR}
    service = kube.get("service", "smollm2-engine", namespace)
    assert service is not None and service["spec"]["clusterIP"] == "None"
    route = kube.get("configmap", "smollm2-gateway-route", namespace)
    assert route is not None and "name: smollm2-engine" in route["data"][ROUTE_GATEWAY_KEY]
    assert "sk-servefleet" not in json.dumps(route)

    # Defaults from the CRD schema are stored.
    assert owner["spec"]["engine"]["tensorParallelSize"] == 1
    assert owner["spec"]["admission"]["maxQueueDepth"] == 64

    s = wait_for(
        "status",
        lambda: (
            status(kube, namespace, "smollm2").get("observedGeneration")
            == owner["metadata"]["generation"]
            and status(kube, namespace, "smollm2")
        ),
    )
    assert s["selector"] == "servefleet.io/component=engine,servefleet.io/llmdeployment=smollm2"
    assert s["endpoint"] == "http://servefleet-gateway.servefleet.svc:8080/v1"
    assert {c["type"] for c in s["conditions"]} == {
        "Ready",
        "Progressing",
        "Degraded",
        "ScalingLimited",
    }

    wait_for("an engine pod", lambda: kube.list("pods", namespace, selector("smollm2")), timeout=60)
    assert condition(kube.get("llmd", "smollm2", namespace), "Ready")["status"] == "False"
    kube.mark_pods_ready(namespace, selector("smollm2"))
    ready = wait_for(
        "Ready=True",
        lambda: (
            (c := condition(kube.get("llmd", "smollm2", namespace), "Ready"))
            and c["status"] == "True"
            and c
        ),
        timeout=60,
    )
    assert ready["reason"] == "WarmPoolReady"
    table = kube.kubectl("get", "llmd", "-n", namespace)
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "MODEL", "ENGINE", "READY", "DESIRED", "QUEUE", "AGE"]
    assert row.split()[:6] == ["smollm2", "smollm2-135m-instruct", "servefleet", "1", "1", "0"]
    events = kube.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.kind=LLMDeployment"
    )
    assert "WarmPoolReady" in events


INVALID = [
    (
        "min-over-max",
        {"pool": {"minReplicas": 4, "maxReplicas": 2}},
        "pool.minReplicas must be <= pool.maxReplicas",
    ),
    (
        "spill-no-key",
        {"spillover": {"enabled": True, "baseURL": "https://api.example.com/v1", "model": "gpt"}},
        "spillover.enabled needs baseURL, model and apiKeySecretRef",
    ),
    (
        "two-sources",
        {
            "model": {
                "name": "m",
                "source": {"builtin": "smollm2-135m-instruct", "url": "https://x/y.gguf"},
            }
        },
        "exactly one of builtin, pvc, url, huggingface, s3 or oci",
    ),
    ("bad-engine", {"engine": {"kind": "tgi"}}, 'supported values: "servefleet", "vllm", "sglang"'),
    (
        "tp-on-servefleet-gpus",
        {"engine": {"tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": 4}}}},
        "servefleet runs one rank per pod",
    ),
    (
        "pp-stage-per-pod",
        {
            "model": VLLM_ON_URL,
            "engine": {
                "kind": "vllm",
                "tensorParallelSize": 2,
                "pipelineParallelSize": 2,
                "resources": {"limits": {"nvidia.com/gpu": 3}},
            },
        },
        "runs one pipeline stage per pod",
    ),
    ("unknown-field", {"replicaCount": 3}, 'unknown field "spec.replicaCount"'),
    (
        "bad-tenant",
        {"tenants": [{"name": "Team A", "apiKeySecretRef": {"name": "k", "key": "v"}}]},
        "spec.tenants[0].name",
    ),
    (
        "dup-tenant",
        {
            "tenants": [
                {"name": "a", "apiKeySecretRef": {"name": "k", "key": "v"}},
                {"name": "a", "apiKeySecretRef": {"name": "k", "key": "w"}},
            ]
        },
        "Duplicate value",
    ),
    ("no-model", {"model": None}, "spec.model: Required value"),
    (
        "tp-over-gpus",
        {
            "model": VLLM_ON_URL,
            "engine": {
                "kind": "vllm",
                "tensorParallelSize": 4,
                "resources": {"limits": {"nvidia.com/gpu": 1}},
            },
        },
        "tensorParallelSize must not exceed the GPUs of one replica",
    ),
    (
        "tp-without-gpus",
        {"model": VLLM_ON_URL, "engine": {"kind": "sglang", "tensorParallelSize": 2}},
        "tensorParallelSize must not exceed the GPUs of one replica",
    ),
    (
        "unknown-builtin",
        {"model": {"name": "m", "source": {"builtin": "llama-9000"}}},
        'supported values: "smollm2-135m-instruct"',
    ),
    (
        "awq-on-servefleet",
        {
            "model": {
                "name": "m",
                "source": {"builtin": "smollm2-135m-instruct"},
                "quantization": "awq",
            }
        },
        "awq, gptq and fp8 need engine.kind vllm or sglang",
    ),
    (
        "speculative-on-sglang",
        {
            "model": VLLM_ON_URL,
            "engine": {
                "kind": "sglang",
                "speculative": {"method": "ngram", "numSpeculativeTokens": 4},
            },
        },
        "engine.speculative needs engine.kind servefleet or vllm",
    ),
    (
        "toleration-typo",
        {"scheduling": {"tolerations": [{"key": "gpu", "efect": "NoSchedule"}]}},
        'unknown field "spec.scheduling.tolerations[0].efect"',
    ),
]


def test_invalid_resources_are_rejected_with_clear_messages(
    kube: Kube, installed_chart: Path, namespace: str
) -> None:
    for name, spec, message in INVALID:
        doc = yaml.safe_load(llmd(name))
        doc["spec"].update(spec)
        doc["spec"] = {k: v for k, v in doc["spec"].items() if v is not None}
        done = kube.kubectl_result("create", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc))
        assert done.returncode != 0, f"{name} was accepted"
        assert message in done.stderr, f"{name}: {done.stderr}"
    assert kube.list("llmd", namespace) == []


def test_kubectl_scale_changes_the_pool(
    kube: Kube, operator: OperatorProcess, namespace: str
) -> None:
    kube.apply_text(llmd("scaled", pool={"minReplicas": 1, "maxReplicas": 4}), namespace)
    wait_for("engine deployment", lambda: kube.get("deployment", "scaled-engine", namespace))
    kube.kubectl("scale", "llmd/scaled", "-n", namespace, "--replicas=3")
    wait_for(
        "3 replicas",
        lambda: (
            (d := kube.get("deployment", "scaled-engine", namespace)) and d["spec"]["replicas"] == 3
        ),
    )
    wait_for(
        "3 pods", lambda: len(kube.list("pods", namespace, selector("scaled"))) == 3, timeout=60
    )
    kube.mark_pods_ready(namespace, selector("scaled"))
    wait_for(
        "status 3/3",
        lambda: (
            (s := status(kube, namespace, "scaled")).get("readyReplicas") == 3
            and s.get("desiredReplicas") == 3
            and s.get("replicas") == 3
        ),
        timeout=60,
        describe=lambda: pool_state(kube, namespace, "scaled"),
    )
    # The operator writes the warm minimum over the version it read only: on this API server
    # a write through the scale subresource over an older version is refused.
    stale = {"metadata": {"resourceVersion": "1"}, "spec": {"replicas": 1}}
    refused = kube.kubectl_result(
        "patch", "llmd/scaled", "-n", namespace, "--subresource=scale", "--type=merge",
        "-p", json.dumps(stale),
    )  # fmt: skip
    assert refused.returncode != 0 and "modified" in refused.stdout + refused.stderr, refused
    scale = json.loads(
        kube.kubectl(
            "get",
            "--raw",
            f"/apis/servefleet.io/v1alpha1/namespaces/{namespace}/llmdeployments/scaled/scale",
        )
    )
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert (
        scale["status"]["selector"]
        == "servefleet.io/component=engine,servefleet.io/llmdeployment=scaled"
    )
    # Above maxReplicas is clamped (as HPA does) and said in status, never refused: a GitOps
    # re-apply that lowers maxReplicas after a scale-up must go through.
    kube.kubectl("scale", "llmd/scaled", "-n", namespace, "--replicas=9")
    wait_for(
        "ScalingLimited",
        lambda: any(
            c.get("type") == "ScalingLimited"
            and c.get("status") == "True"
            and "above pool.maxReplicas 4" in c.get("message", "")
            for c in status(kube, namespace, "scaled").get("conditions", [])
        ),
        timeout=60,
    )
    # The condition is a fact about the spec, so a status refresh may say it just before the
    # reconcile of the same change has applied the clamped count.
    wait_for(
        "clamped to maxReplicas",
        lambda: kube.get("deployment", "scaled-engine", namespace)["spec"]["replicas"] == 4,
    )
    kube.apply_text(llmd("scaled", pool={"minReplicas": 1, "maxReplicas": 2}), namespace)
    wait_for(
        "clamped to the lowered maximum",
        lambda: kube.get("deployment", "scaled-engine", namespace)["spec"]["replicas"] == 2,
    )
    kube.kubectl("scale", "llmd/scaled", "-n", namespace, "--replicas=1")
    wait_for(
        "1 replica",
        lambda: (
            len(
                [
                    p
                    for p in kube.list("pods", namespace, selector("scaled"))
                    if not p["metadata"].get("deletionTimestamp")
                ]
            )
            == 1
        ),
        timeout=60,
    )


def test_spec_change_rolls_out_keeping_the_warm_minimum(
    kube: Kube, operator: OperatorProcess, namespace: str
) -> None:
    kube.apply_text(
        llmd("rolling", replicas=3, pool={"minReplicas": 2, "maxReplicas": 4}), namespace
    )
    wait_for(
        "3 pods", lambda: len(kube.list("pods", namespace, selector("rolling"))) == 3, timeout=60
    )
    kube.mark_pods_ready(namespace, selector("rolling"))
    wait_for(
        "3 ready",
        lambda: status(kube, namespace, "rolling").get("readyReplicas") == 3,
        timeout=60,
        describe=lambda: pool_state(kube, namespace, "rolling"),
    )
    old_hash = {
        p["metadata"]["labels"]["pod-template-hash"]
        for p in kube.list("pods", namespace, selector("rolling"))
    }

    kube.kubectl(
        "patch",
        "llmd/rolling",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"engine":{"maxNumSeqs":8}}}',
    )
    lowest, deadline = 3, time.monotonic() + 120
    while time.monotonic() < deadline:
        lowest = min(lowest, ready_pods(kube, namespace, "rolling"))
        pods = [
            p
            for p in kube.list("pods", namespace, selector("rolling"))
            if not p["metadata"].get("deletionTimestamp")
        ]
        hashes = {p["metadata"]["labels"]["pod-template-hash"] for p in pods}
        if len(pods) == 3 and not hashes & old_hash and all(is_ready(p) for p in pods):
            break
        # The kubelet's part: one new pod becomes ready at a time, after a beat.
        time.sleep(0.5)
        kube.mark_pods_ready(namespace, selector("rolling"), limit=1)
    else:
        pods = kube.list("pods", namespace, selector("rolling"))
        summary = [
            (p["metadata"]["name"], p["metadata"]["labels"]["pod-template-hash"], is_ready(p))
            for p in pods
        ]
        deployment = kube.get("deployment", "rolling-engine", namespace)
        observed = deployment and deployment["status"]
        raise AssertionError(f"rollout did not finish: pods {summary}, deployment {observed}")
    assert lowest >= 2, f"ready replicas fell to {lowest} during the rollout"
    args = kube.get("deployment", "rolling-engine", namespace)["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "8"
    wait_for(
        "Progressing=False Complete",
        lambda: (
            (c := condition(kube.get("llmd", "rolling", namespace), "Progressing"))
            and c["reason"] == "Complete"
        ),
        timeout=60,
    )


def test_deleting_the_resource_garbage_collects_every_child(
    kube: Kube, operator: OperatorProcess, namespace: str
) -> None:
    kube.apply_text(llmd("doomed"), namespace)
    wait_for(
        "children",
        lambda: all(kube.list(k, namespace, f"{LABEL_DEPLOYMENT}=doomed") for k in CHILD_KINDS),
        timeout=60,
    )
    wait_for("a pod", lambda: kube.list("pods", namespace, selector("doomed")), timeout=60)
    kube.kubectl("delete", "llmd/doomed", "-n", namespace, "--wait=true", "--timeout=60s")
    for kind in [*CHILD_KINDS, "replicaset", "pods"]:
        wait_for(
            f"{kind} collected",
            lambda k=kind: not kube.list(k, namespace, f"{LABEL_DEPLOYMENT}=doomed"),
            timeout=90,
        )


def test_operator_restart_creates_no_duplicates_and_keeps_status(
    kube: Kube, operator: OperatorProcess, namespace: str
) -> None:
    names = [f"restart-{i}" for i in range(4)]
    kube.apply_text("---\n".join(llmd(n) for n in names), namespace)
    wait_for("first engine deployment", lambda: kube.list("deployment", namespace), timeout=60)
    operator.restart(hard=True)  # mid-way: some children may exist, some not yet
    for n in names:
        wait_for(
            f"{n} reconciled",
            lambda n=n: reconciled(kube.get("llmd", n, namespace)),
            timeout=90,
        )
    kube.mark_pods_ready(namespace, ENGINE)
    for n in names:
        wait_for(
            f"{n} ready",
            lambda n=n: status(kube, namespace, n).get("readyReplicas") == 1,
            timeout=60,
        )
    # The autoscaler's field, which the operator must never clobber.
    kube.kubectl(
        "patch",
        "llmd/restart-0",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status":{"queueDepth":5}}',
    )
    # What the restart must keep is the settled status: the operator may still be folding in
    # the pods' readiness (a condition's lastTransitionTime) when the last one reads ready.
    seen: list[dict[str, Any]] = []

    def settled() -> dict[str, Any] | None:
        seen.append({n: status(kube, namespace, n) for n in names})
        return seen[-1] if len(seen) > 1 and seen[-1] == seen[-2] else None

    before = wait_for("the status to settle", settled, timeout=60, interval=4)

    operator.restart(hard=False)
    time.sleep(8)  # resume handlers and at least two drift-repair rounds
    operator.assert_alive()
    after = {n: status(kube, namespace, n) for n in names}
    assert after == before
    for kind in ["deployment", "service", "configmap", "poddisruptionbudget", "replicaset"]:
        counts = {n: len(kube.list(kind, namespace, f"{LABEL_DEPLOYMENT}={n}")) for n in names}
        assert set(counts.values()) == {1}, f"{kind}: {counts}"
    assert len(kube.list("pods", namespace, ENGINE)) == len(names)


def test_drift_is_repaired(kube: Kube, operator: OperatorProcess, namespace: str) -> None:
    kube.apply_text(llmd("drifty"), namespace)
    wait_for("service", lambda: kube.get("service", "drifty-engine", namespace), timeout=60)
    kube.kubectl("delete", "service", "drifty-engine", "-n", namespace)
    kube.kubectl("scale", "deployment/drifty-engine", "-n", namespace, "--replicas=0")
    wait_for("service back", lambda: kube.get("service", "drifty-engine", namespace), timeout=30)
    wait_for(
        "replicas back",
        lambda: kube.get("deployment", "drifty-engine", namespace)["spec"]["replicas"] == 1,
        timeout=30,
    )


def test_fifty_deployments_are_reconciled(
    kube: Kube, operator: OperatorProcess, namespace: str
) -> None:
    names = [f"fleet-{i:02d}" for i in range(50)]
    start = time.monotonic()
    kube.apply_text("---\n".join(llmd(n) for n in names), namespace)

    def all_reconciled() -> bool:
        items = kube.list("llmd", namespace)
        done = [i for i in items if reconciled(i) and i["status"].get("selector")]
        return len(done) == 50 and len(kube.list("deployment", namespace)) == 50

    wait_for("50 LLMDeployments reconciled", all_reconciled, timeout=300, interval=1.0)
    elapsed = time.monotonic() - start
    print(f"\n50 LLMDeployments reconciled (children applied, status written) in {elapsed:.1f}s")


class QueuedGateway:
    """Stands in for the gateways: `queued` requests wait for `name`."""

    def __init__(self, name: str, queued: int) -> None:
        self.stats = {name: DeploymentStats(name=name, queue_depth=queued)}

    async def deployments(self) -> dict[str, DeploymentStats]:
        return self.stats


def test_autoscaler_scales_reports_the_queue_and_explains_with_its_rbac(
    kube: Kube, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    """The autoscaler's calls, made as the chart's autoscaler ServiceAccount."""
    kube.apply_text(
        llmd(
            "auto", pool={"minReplicas": 1, "maxReplicas": 3}, autoscaling={"targetPerReplica": 4}
        ),
        namespace,
    )
    wait_for("status.selector", lambda: status(kube, namespace, "auto").get("selector"), timeout=60)
    kubeconfig = kube.service_account_kubeconfig(
        SYSTEM_NAMESPACE, f"{RELEASE}-autoscaler", tmp_path / "autoscaler.kubeconfig"
    )

    async def one_tick() -> list[str]:
        access = KubeAccess(kubeconfig=str(kubeconfig))
        async with await access.connect() as client, httpx.AsyncClient() as http:
            # Listing the gateway Service's EndpointSlices is allowed (none are ready here).
            fleet = GatewayFleetSource(client, SYSTEM_NAMESPACE, f"{RELEASE}-gateway", http)
            endpoints = await fleet.endpoints()
            # The gateway names a route's deployment <namespace>/<name>.
            gateways = QueuedGateway(f"{namespace}/auto", queued=12)
            scaler = ClusterAutoscaler(client, [namespace], gateways, AutoscalerMetrics(), http)
            await scaler.tick()
        return endpoints

    assert asyncio.run(one_tick()) == []
    assert status(kube, namespace, "auto")["queueDepth"] == 12
    llm = kube.get("llmd", "auto", namespace)
    assert llm is not None and llm["spec"]["replicas"] == 3  # 12 queued / 4 per replica
    events = kube.kubectl(
        "get", "events", "-n", namespace, "--field-selector=reason=Scaled", "-o", "json"
    )
    messages = [e["message"] for e in json.loads(events)["items"]]
    assert any(" -> 3: " in m for m in messages), messages


def test_scale_down_removes_the_replica_the_autoscaler_ranked_lowest(
    kube: Kube, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    """The autoscaler may not write pods: it ranks them in status.podDeletionCosts (as its
    ServiceAccount), the operator copies the ranks to the pods' deletion cost before it
    scales the engine Deployment, and the ReplicaSet removes the victim."""
    kube.apply_text(
        llmd("ranked", replicas=3, pool={"minReplicas": 1, "maxReplicas": 3}), namespace
    )
    wait_for(
        "3 pods", lambda: len(kube.list("pods", namespace, selector("ranked"))) == 3, timeout=60
    )
    kube.mark_pods_ready(namespace, selector("ranked"))
    pods = sorted(p["metadata"]["name"] for p in kube.list("pods", namespace, selector("ranked")))
    victim = pods[1]
    kubeconfig = kube.service_account_kubeconfig(
        SYSTEM_NAMESPACE, f"{RELEASE}-autoscaler", tmp_path / "autoscaler.kubeconfig"
    )
    replicas = tuple(
        ReplicaLoad(name=name, state=ReplicaState.READY, running=0 if name == victim else 3)
        for name in pods
    )
    decision = Decision(
        desired=2,
        current=3,
        reason=Reason.SCALE_DOWN,
        victim=victim,
        demand=3,
        state=PolicyState(),
        message="down 3→2",
    )

    async def scale_down() -> None:
        async with await KubeAccess(kubeconfig=str(kubeconfig)).connect() as client:
            actuator = KubernetesActuator(client, namespace)
            await actuator.apply("ranked", decision, Observation(replicas=replicas))

    asyncio.run(scale_down())
    wait_for(
        "the victim to go",
        lambda: (
            [
                p["metadata"]["name"]
                for p in kube.list("pods", namespace, selector("ranked"))
                if p["metadata"].get("deletionTimestamp") is None
            ]
            == [name for name in pods if name != victim]
        ),
        timeout=60,
    )
    costs = status(kube, namespace, "ranked")["podDeletionCosts"]
    assert {c["pod"]: c["cost"] for c in costs}[victim] == -1


def test_operator_was_never_forbidden(operator: OperatorProcess) -> None:
    operator.assert_alive()
    logs = operator.logs()
    assert "forbidden" not in logs.lower(), logs[-4000:]
    assert "Traceback" not in logs, logs[-4000:]
