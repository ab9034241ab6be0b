"""LLMAdapters judged by the real operator on a real API server, served in its signed route,
and reported loaded by the autoscaler, each as its chart ServiceAccount.

The adapters' `adapter_config.json` files come from a Hub-compatible file server in the test
(what `source.huggingface.endpoint` points at); the operator process reads them itself. There
is no kubelet here: a pod's address is written the way the kubelet would write it, and the
gateways' view of which replica holds which adapter is a stub of their stats.

    uv run pytest e2e/test_llmadapter_operator.py -q -x
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
import yaml
from conftest import RELEASE, SYSTEM_NAMESPACE
from k8s.kube_gateway import KubeGateway
from k8s.kubectl import Kube, OperatorProcess, condition, wait_for
from pydantic import SecretStr

from servefleet.api.conventions import LABEL_DEPLOYMENT, ROUTE_GATEWAY_KEY
from servefleet.api.gateway_config import GatewayConfig, hash_api_key
from servefleet.api.gateway_stats import DeploymentStats, GatewayReplicaStats
from servefleet.api.route_signature import read_signing_key
from servefleet.autoscaler.cluster import ClusterAutoscaler
from servefleet.autoscaler.telemetry import AutoscalerMetrics
from servefleet.gateway.route_merge import (
    ResolvedSecrets,
    SecretKeyPath,
    merge_routes,
    parse_route,
    resolve_route,
)
from servefleet.kube import KubeAccess
from tests.support.model_servers import HubRepo, ModelFileServer, model_file_server

BASE = "smollm2-135m-instruct"
OTHER_BASE = "meta-llama/Llama-3.2-1B"
MAX_RANK = 16
TENANTS = ("alpha", "beta")
KEYS = {t: f"sk-e2e-llma-{t}-0123456789" for t in TENANTS}


def peft_config(r: int, base: str) -> bytes:
    """An adapter_config.json as PEFT writes it (more fields than the operator reads)."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": 2 * r,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": base,
        "bias": "none",
    }
    return json.dumps(config).encode()


REPOS = {
    "acme/smol-support": peft_config(8, BASE),
    "acme/smol-support-v2": peft_config(8, BASE),
    "acme/llama-support": peft_config(8, OTHER_BASE),
    "acme/smol-wide": peft_config(64, BASE),
}


@pytest.fixture(scope="module")
def hub() -> Iterator[ModelFileServer]:
    """A Hub-compatible file API (`<repo>/resolve/<revision>/<file>`); records each GET."""
    repos = {repo: HubRepo(files={"adapter_config.json": body}) for repo, body in REPOS.items()}
    with model_file_server(ModelFileServer(repos=repos)) as server:
        yield server


@pytest.fixture
def namespace(kube: Kube, installed_chart: Path, request: pytest.FixtureRequest) -> str:
    name = "e2e-llmao-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].strip("-")
    kube.create_namespace(name)
    return name


def llmd(name: str, lora: bool, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name": f"{name}-chat", "source": {"builtin": BASE}},
        "tenants": [
            {"name": t, "apiKeySecretRef": {"name": f"{t}-key", "key": "api-key"}} for t in TENANTS
        ],
        # The autoscaler's adapter report needs no scaling; no pod here is scraped.
        "autoscaling": {"enabled": False},
        **spec,
    }
    if lora:
        body["engine"] = {"lora": {"maxLoras": 4, "maxLoraRank": MAX_RANK}}
    return {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name},
        "spec": body,
    }


def llma(
    name: str, hub: ModelFileServer, repo: str, deployment: str = "smol", **spec: Any
) -> dict[str, Any]:
    source = {"huggingface": {"repo": repo, "endpoint": hub.url}}
    return {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMAdapter",
        "metadata": {"name": name},
        "spec": {"deployment": deployment, "source": source, **spec},
    }


def key_secrets() -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"{t}-key"},
            "stringData": {"api-key": KEYS[t]},
        }
        for t in TENANTS
    ]


def apply(kube: Kube, namespace: str, *docs: dict[str, Any]) -> None:
    kube.apply_text(yaml.safe_dump_all(docs), namespace)


def judged(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    """The adapter once `Accepted` is written for its current generation."""
    obj = kube.get("llma", name, namespace)
    accepted = condition(obj, "Accepted")
    if obj is None or accepted is None:
        return None
    if accepted.get("observedGeneration") != obj["metadata"]["generation"]:
        return None
    return obj


def accepted(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    """The adapter's Accepted condition, once written for its current generation."""
    obj = wait_for(f"LLMAdapter {name} judged", lambda: judged(kube, namespace, name), timeout=60)
    found = condition(obj, "Accepted")
    assert found is not None
    return found


def route_deployment(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    """The deployment's fragment of its route ConfigMap, as the operator rendered it."""
    route = kube.get("configmap", f"{name}-gateway-route", namespace)
    if route is None:
        return None
    (deployment,) = yaml.safe_load(route["data"][ROUTE_GATEWAY_KEY])["deployments"]
    return dict(deployment)


def route_names(kube: Kube, namespace: str, name: str) -> list[str] | None:
    """The adapters in the deployment's route (None: no route yet)."""
    found = route_deployment(kube, namespace, name)
    return None if found is None else sorted(a["name"] for a in found.get("adapters", []))


def test_adapters_are_judged_at_reconcile_served_in_the_route_and_listed(
    kube: Kube,
    operator: OperatorProcess,
    hub: ModelFileServer,
    namespace: str,
    route_key_file: Path,
    tmp_path: Path,
) -> None:
    apply(kube, namespace, *key_secrets(), llmd("smol", lora=True), llmd("plain", lora=False))
    apply(
        kube,
        namespace,
        llma("support", hub, "acme/smol-support", model="team-a/support", tenants=["alpha"]),
        llma("llama", hub, "acme/llama-support"),
        llma("wide", hub, "acme/smol-wide"),
        llma("stray", hub, "acme/smol-support", deployment="plain"),
    )

    # The one trained on the deployment's model, within its rank: accepted, with its config.
    ok = accepted(kube, namespace, "support")
    assert (ok["status"], ok["reason"]) == ("True", "Accepted"), ok
    assert "rank 8" in ok["message"] and "team-a/support" in ok["message"], ok
    support = kube.get("llma", "support", namespace)
    assert support is not None
    status = support["status"]
    assert (status["rank"], status["targetModules"]) == (8, ["q_proj", "v_proj"])
    assert status["baseModel"] == "smol-chat"
    assert hub.gets("/acme/smol-support/resolve/main/adapter_config.json")

    # Another base model: refused, the message naming both.
    llama = accepted(kube, namespace, "llama")
    assert (llama["status"], llama["reason"]) == ("False", "BaseModelMismatch"), llama
    assert OTHER_BASE in llama["message"] and BASE in llama["message"], llama
    # A rank above the deployment's limit: refused, naming the rank and the limit.
    wide = accepted(kube, namespace, "wide")
    assert (wide["status"], wide["reason"]) == ("False", "AdapterNotServable"), wide
    assert "r 64" in wide["message"] and f"--max-lora-rank {MAX_RANK}" in wide["message"], wide
    # A deployment whose engines serve no adapters.
    stray = accepted(kube, namespace, "stray")
    assert (stray["status"], stray["reason"]) == ("False", "LoraNotEnabled"), stray
    assert "deployment plain" in stray["message"], stray
    for name in ("llama", "wide", "stray"):
        refused = kube.get("llma", name, namespace)
        assert refused is not None and "rank" not in refused["status"], refused["status"]
    # A Warning Event on each refused adapter, as `kubectl describe` shows it.
    wait_for("the Warning Events", lambda: len(adapter_warnings(kube, namespace)) == 3)
    assert adapter_warnings(kube, namespace) == {
        "llama": "BaseModelMismatch",
        "wide": "AdapterNotServable",
        "stray": "LoraNotEnabled",
    }

    check_route(kube, namespace, hub, route_key_file)
    check_columns(kube, namespace)
    check_tenant_views(kube, namespace, route_key_file, tmp_path)


def adapter_warnings(kube: Kube, namespace: str) -> dict[str, str]:
    """The reasons of the Warning Events on the namespace's LLMAdapters, by adapter."""
    listed = kube.kubectl(
        "get", "events", "-n", namespace, "--field-selector=type=Warning", "-o", "json"
    )
    return {
        e["involvedObject"]["name"]: e["reason"]
        for e in json.loads(listed)["items"]
        if e["involvedObject"]["kind"] == "LLMAdapter"
    }


def check_route(kube: Kube, namespace: str, hub: ModelFileServer, route_key_file: Path) -> None:
    """Only the accepted adapter is in smol's route, loaded by the engines from the same Hub;
    the route passes the gateway's own checks (signed with the chart's key), and its
    adapter's tenants are scoped to the namespace like the tenants themselves."""
    wait_for("the route with the adapter", lambda: route_names(kube, namespace, "smol"))
    (entry,) = (route_deployment(kube, namespace, "smol") or {})["adapters"]
    assert entry == {
        "name": "team-a/support",
        "path": f"hf://acme/smol-support@main?{urlencode({'endpoint': hub.url})}",
        "tenants": ["alpha"],
    }
    plain = route_deployment(kube, namespace, "plain")
    assert plain is not None and "adapters" not in plain  # the route as before adapters

    route = parse_route(
        kube.get("configmap", "smol-gateway-route", namespace) or {},
        read_signing_key(route_key_file),
    )
    secrets = ResolvedSecrets(
        digests={SecretKeyPath(namespace, f"{t}-key", "api-key"): hash_api_key(k)
                 for t, k in KEYS.items()},
        values={SecretKeyPath(namespace, "smol-engine-key", "api-key"): SecretStr("e")},
    )  # fmt: skip
    resolved, problems = resolve_route(route, secrets)
    assert problems == []
    merged = merge_routes(GatewayConfig(), [(route, resolved)])
    assert merged.rejected == {} and merged.served == [route.id]
    (served,) = merged.config.deployments
    assert served.name == f"{namespace}/smol"
    assert [(a.name, a.tenants) for a in served.adapters] == [
        ("team-a/support", [f"{namespace}/alpha"])
    ]


def check_tenant_views(kube: Kube, namespace: str, route_key_file: Path, work: Path) -> None:
    """The gateway itself, as its chart ServiceAccount (the route and the key Secrets read
    through the API server): alpha lists the adapter with its parent; beta neither lists
    nor reaches it (404 model_not_found, as for a model it cannot see)."""
    kubeconfig = kube.service_account_kubeconfig(
        SYSTEM_NAMESPACE, f"{RELEASE}-gateway", work / "gateway.kubeconfig"
    )
    gateway = KubeGateway(kubeconfig, route_key_file, work)

    def models(tenant: str) -> dict[str, dict[str, Any]]:
        assert gateway.alive(), f"gateway died:\n{gateway.logs()[-4000:]}"
        headers = {"authorization": f"Bearer {KEYS[tenant]}"}
        try:
            listed = httpx.get(gateway.url + "/v1/models", headers=headers, timeout=5)
        except httpx.HTTPError:
            return {}
        return {m["id"]: m for m in listed.json()["data"]} if listed.status_code == 200 else {}

    try:
        served = lambda: models("alpha").get("team-a/support")  # noqa: E731
        alpha = wait_for("the gateway to serve the route", served, timeout=90)
        assert (alpha["parent"], alpha["root"]) == ("smol-chat", "team-a/support")
        assert sorted(models("beta")) == ["plain-chat", "smol-chat"]
        refused = gateway.chat(KEYS["beta"], "team-a/support")
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["code"] == "model_not_found"
    finally:
        gateway.stop()


def check_columns(kube: Kube, namespace: str) -> None:
    """`kubectl get llma` (and `-o wide`): the columns, from the operator's status."""
    table = kube.kubectl("get", "llma", "-n", namespace)
    print(table)
    header, rows = columns(table)
    assert header == ["NAME", "DEPLOYMENT", "MODEL", "RANK", "ACCEPTED", "LOADED", "AGE"]
    assert rows["support"][:6] == ["support", "smol", "team-a/support", "8", "True", ""]
    assert rows["llama"][:6] == ["llama", "smol", "", "", "False", ""]
    assert rows["wide"][:6] == ["wide", "smol", "", "", "False", ""]
    assert rows["stray"][:6] == ["stray", "plain", "", "", "False", ""]
    header, rows = columns(kube.kubectl("get", "llma", "-n", namespace, "-o", "wide"))
    assert header[:7] == ["NAME", "DEPLOYMENT", "MODEL", "RANK", "ACCEPTED", "LOADED", "REASON"]
    assert rows["support"][6] == ""  # no Loaded condition until the autoscaler writes one


def columns(table: str) -> tuple[list[str], dict[str, list[str]]]:
    """`kubectl get` output as (header, {name: cells}); cut at the header's offsets, as
    kubectl leaves an empty cell blank."""
    header, *lines = table.splitlines()
    names = header.split()
    starts = [header.index(f" {n}") + 1 if i else 0 for i, n in enumerate(names)]
    ends = [*starts[1:], None]
    rows = [[line[a:b].strip() for a, b in zip(starts, ends, strict=True)] for line in lines]
    return names, {row[0]: row for row in rows}


class AdapterGateways:
    """Stands in for the gateways' stats of one deployment: which replica holds which
    adapter, and the adapters whose last load failed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stats: dict[str, DeploymentStats] = {}

    def hold(self, holders: dict[str, list[str]], errors: dict[str, str] | None = None) -> None:
        replicas = [
            GatewayReplicaStats(endpoint=endpoint, adapters=adapters)
            for endpoint, adapters in holders.items()
        ]
        self.stats = {
            self.name: DeploymentStats(
                name=self.name, replicas=replicas, adapter_load_errors=errors or {}
            )
        }

    async def deployments(self) -> dict[str, DeploymentStats]:
        return self.stats


def engine_pods(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    return [
        p
        for p in kube.list("pods", namespace, f"{LABEL_DEPLOYMENT}={name}")
        if not p["metadata"].get("deletionTimestamp")
    ]


def give_address(kube: Kube, namespace: str, pod: str, ip: str) -> None:
    """The kubelet's part: the pod's address, and Running + Ready."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    conditions = [
        {"type": t, "status": "True", "lastTransitionTime": now}
        for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
    ]
    status = {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "conditions": conditions,
        "startTime": now,
    }
    kube.kubectl(
        "patch", "pod", pod, "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip


def engine_port(pod: dict[str, Any]) -> int:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "http"]
    return int(port)


def address_pods(kube: Kube, namespace: str, name: str) -> dict[str, str]:
    """The deployment's two engine pods given an IPv4 and an IPv6 address; each pod's name
    with the URL the gateways name its replica by (an IPv6 one in brackets)."""
    pods = wait_for(
        "2 engine pods",
        lambda: len(p := engine_pods(kube, namespace, name)) == 2 and p,
        timeout=60,
    )
    port = engine_port(pods[0])
    addresses = {
        pods[0]["metadata"]["name"]: "10.244.0.7",
        pods[1]["metadata"]["name"]: "fd00:10:244::8",
    }
    for pod, ip in addresses.items():
        give_address(kube, namespace, pod, ip)
    return {
        pod: f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"
        for pod, ip in addresses.items()
    }


def can_i(kube: Kube, identity: str, verb: str, resource: str, namespace: str) -> bool:
    """What the API server's authorizer answers for `identity` ("resource/subresource")."""
    name, _, sub = resource.partition("/")
    args = ["auth", "can-i", verb, name, "-n", namespace, f"--as={identity}"]
    done = kube.kubectl_result(*args, *([f"--subresource={sub}"] if sub else []))
    return done.stdout.strip() == "yes"


def test_autoscaler_reports_where_an_adapter_is_loaded_and_why_a_load_failed(
    kube: Kube, operator: OperatorProcess, hub: ModelFileServer, namespace: str, tmp_path: Path
) -> None:
    pool = {"minReplicas": 1, "maxReplicas": 2}
    apply(kube, namespace, llmd("smol", lora=True, replicas=2, pool=pool))
    apply(
        kube,
        namespace,
        llma("support", hub, "acme/smol-support"),
        llma("llama", hub, "acme/llama-support"),
    )
    assert accepted(kube, namespace, "support")["status"] == "True"
    assert accepted(kube, namespace, "llama")["status"] == "False"
    endpoints = address_pods(kube, namespace, "smol")

    identity = f"system:serviceaccount:{SYSTEM_NAMESPACE}:{RELEASE}-autoscaler"
    assert can_i(kube, identity, "list", "llmadapters.servefleet.io", namespace)
    assert can_i(kube, identity, "patch", "llmadapters.servefleet.io/status", namespace)
    assert not can_i(kube, identity, "patch", "llmadapters.servefleet.io", namespace)
    assert not can_i(kube, identity, "create", "llmadapters.servefleet.io", namespace)
    kubeconfig = kube.service_account_kubeconfig(
        SYSTEM_NAMESPACE, f"{RELEASE}-autoscaler", tmp_path / "autoscaler.kubeconfig"
    )
    gateways = AdapterGateways(f"{namespace}/smol")

    async def tick() -> None:
        async with await KubeAccess(kubeconfig=str(kubeconfig)).connect() as client, \
                httpx.AsyncClient() as http:  # fmt: skip
            scaler = ClusterAutoscaler(client, [namespace], gateways, AutoscalerMetrics(), http)
            await scaler.tick()

    # Both replicas hold the accepted adapter (the refused one is in nobody's stats).
    judged_version = (kube.get("llma", "support", namespace) or {})["metadata"]["resourceVersion"]
    gateways.hold({endpoints[pod]: ["support"] for pod in endpoints})
    asyncio.run(tick())
    support = kube.get("llma", "support", namespace)
    assert support is not None
    assert support["status"]["loadedReplicas"] == sorted(endpoints)  # the pods' names
    loaded = condition(support, "Loaded")
    assert loaded is not None and (loaded["status"], loaded["reason"]) == ("True", "Loaded")
    assert loaded["message"] == "held by 2 replica(s)"
    assert condition(support, "Accepted")["status"] == "True"  # the operator's, kept
    llama = kube.get("llma", "llama", namespace)
    assert llama is not None and condition(llama, "Loaded") is None
    assert "loadedReplicas" not in llama["status"]

    table = kube.kubectl("get", "llma", "-n", namespace, "-o", "wide")
    print(table)
    _, rows = columns(table)
    assert json.loads(rows["support"][5]) == sorted(endpoints)
    assert rows["support"][6] == "Loaded"
    assert rows["llama"][5:7] == ["", ""]
    # What both writers of `conditions` rely on: a status patch made on an older version
    # is refused by the API server, not merged over the newer one.
    stale = {"metadata": {"resourceVersion": judged_version}, "status": {"loadedReplicas": []}}
    crossed = kube.kubectl_result(
        "patch", "llma", "support", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps(stale),
    )  # fmt: skip
    assert crossed.returncode != 0 and "has been modified" in crossed.stderr, crossed.stderr

    # The engine refused the adapter's last load: nobody holds it, Loaded=False LoadFailed.
    why = "HTTP 400: lora_path hf://acme/smol-support@main: adapter_model.safetensors not found"
    gateways.hold({endpoints[pod]: [] for pod in endpoints}, errors={"support": why})
    asyncio.run(tick())
    support = kube.get("llma", "support", namespace)
    assert support is not None
    assert support["status"]["loadedReplicas"] == []
    failed = condition(support, "Loaded")
    assert failed is not None
    assert (failed["status"], failed["reason"], failed["message"]) == ("False", "LoadFailed", why)

    # The operator's drift-repair passes keep the autoscaler's condition and its Accepted.
    time.sleep(3 * operator.resync_seconds)
    support = kube.get("llma", "support", namespace)
    assert support is not None
    assert condition(support, "Loaded") == failed
    assert condition(support, "Accepted")["status"] == "True"

    # Refused later (its source now another base model's), while the engines still hold
    # it: where it was loaded is no longer shown beside Accepted=False.
    gateways.hold({endpoints[pod]: ["support"] for pod in endpoints})
    asyncio.run(tick())
    kube.kubectl(
        "patch", "llma", "support", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"source": {"huggingface": {"repo": "acme/llama-support"}}}}),
    )  # fmt: skip
    assert accepted(kube, namespace, "support")["reason"] == "BaseModelMismatch"
    asyncio.run(tick())
    support = kube.get("llma", "support", namespace)
    assert support is not None
    assert condition(support, "Loaded") is None and "loadedReplicas" not in support["status"]
    assert condition(support, "Accepted")["reason"] == "BaseModelMismatch"


def test_changing_or_deleting_an_adapter_changes_its_route_and_its_rivals_verdicts(
    kube: Kube, operator: OperatorProcess, hub: ModelFileServer, namespace: str
) -> None:
    apply(kube, namespace, llmd("smol", lora=True))
    apply(kube, namespace, llma("llama", hub, "acme/llama-support"))
    apply(kube, namespace, llma("support", hub, "acme/smol-support"))
    assert accepted(kube, namespace, "llama")["reason"] == "BaseModelMismatch"
    assert accepted(kube, namespace, "support")["status"] == "True"
    wait_for("support routed", lambda: route_names(kube, namespace, "smol") == ["support"])

    # Fixed: pointed at an adapter trained on the deployment's model, it is routed.
    kube.kubectl(
        "patch", "llma", "llama", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"source": {"huggingface": {"repo": "acme/smol-support-v2"}}}}),
    )  # fmt: skip
    assert accepted(kube, namespace, "llama")["status"] == "True"
    wait_for("llama routed", lambda: route_names(kube, namespace, "smol") == ["llama", "support"])

    # A served name taken by an older adapter: refused, naming it.
    apply(kube, namespace, llma("copycat", hub, "acme/smol-support", model="llama"))
    copycat = accepted(kube, namespace, "copycat")
    assert (copycat["status"], copycat["reason"]) == ("False", "NameConflict"), copycat
    assert "LLMAdapter llama" in copycat["message"], copycat

    # Tenants the deployment does not have: refused, naming them and the deployment's own.
    kube.kubectl(
        "patch", "llma", "support", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"tenants": ["gamma"]}}),
    )  # fmt: skip
    support = accepted(kube, namespace, "support")
    assert (support["status"], support["reason"]) == ("False", "UnknownTenants"), support
    assert "gamma" in support["message"] and "alpha, beta" in support["message"], support
    wait_for("support unrouted", lambda: route_names(kube, namespace, "smol") == ["llama"])

    # Deleted: out of the route, and the name it held goes to the adapter refused for it.
    kube.kubectl("delete", "llma", "llama", "-n", namespace)
    copycat = wait_for(
        "copycat accepted",
        lambda: (
            (c := condition(kube.get("llma", "copycat", namespace), "Accepted"))
            and c["status"] == "True"
            and c
        ),
        timeout=60,
    )
    assert "as model llama" in copycat["message"], copycat
    (entry,) = wait_for(
        "the route to serve copycat as llama",
        lambda: (
            (d := route_deployment(kube, namespace, "smol"))
            and [
                a for a in d.get("adapters", []) if a["path"].startswith("hf://acme/smol-support@")
            ]
        ),
    )
    assert entry["name"] == "llama"
    operator.assert_alive()
    forbidden = [line for line in operator.logs().splitlines() if "forbidden" in line.lower()]
    assert forbidden == [], forbidden
