"""Disaggregated prefill/decode in the operator: the prefill pool's objects, its pods'
roles, flags and resources, the engine NetworkPolicy over both pools, the route's prefill
block, status, and removal of the pool when the block is deleted."""

from __future__ import annotations

import json
from typing import Any

import yaml

from servefleet.api.conventions import ROUTE_GATEWAY_KEY, engine_selector, prefill_selector
from servefleet.api.gateway_config import GatewayConfig
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.kube.resources import Resource
from servefleet.operator import render
from servefleet.operator.status import EventSpec
from tests.test_operator_reconciler import RecordingClient, reconciler

SETTINGS = render.RenderSettings(
    engine_image="servefleet:test",
    gateway_url="http://gw:8080",
    route_signing_key=b"k" * 32,
    system_namespace="sf-system",
)


def make(
    kind: str = "servefleet", pd: dict[str, Any] | None = None, **status: Any
) -> LLMDeployment:
    source = (
        {"builtin": "smollm2-135m-instruct"}
        if kind == "servefleet"
        else {"pvc": {"claimName": "w"}}
    )
    spec: dict[str, Any] = {
        "model": {"name": "m", "source": source},
        "engine": {"kind": kind, "resources": {"requests": {"cpu": "2"}}},
        "pool": {"minReplicas": 1, "maxReplicas": 3},
    }
    if pd is not None:
        spec["disaggregation"] = pd
    return LLMDeployment.model_validate(
        {
            "metadata": {"name": "m", "namespace": "ns", "uid": "u1", "generation": 2},
            "spec": spec,
            "status": status,
        }
    )


def objects(dep: LLMDeployment) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render.children(dep, SETTINGS, False)}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


PD = {
    "prefill": {
        "minReplicas": 1,
        "maxReplicas": 4,
        "replicas": 2,
        "args": ["--max-num-batched-tokens", "4096"],
        "resources": {"requests": {"cpu": "4"}},
    },
    "threshold": 128,
}


def test_a_disaggregated_deployment_renders_a_prefill_pool_beside_the_decode_pool() -> None:
    objs = objects(make(pd=PD))
    prefill, decode = objs["Deployment", "m-prefill"], objs["Deployment", "m-engine"]
    assert objs["Service", "m-prefill"]["spec"]["selector"] == prefill_selector("m")
    assert objs["Service", "m-engine"]["spec"]["selector"] == engine_selector("m")
    assert prefill["spec"]["replicas"] == 2
    assert decode["spec"]["replicas"] == 1
    assert prefill["spec"]["selector"]["matchLabels"] == prefill_selector("m")
    # The decode pool's selector is unchanged (immutable), and never matches prefill pods.
    assert decode["spec"]["selector"]["matchLabels"] == engine_selector("m")
    prefill_labels = prefill["spec"]["template"]["metadata"]["labels"]
    decode_labels = decode["spec"]["template"]["metadata"]["labels"]
    assert not set(engine_selector("m").items()) <= set(prefill_labels.items())
    assert prefill_labels["servefleet.io/role"] == prefill_labels["llm-d.ai/role"] == "prefill"
    assert decode_labels["servefleet.io/role"] == decode_labels["llm-d.ai/role"] == "decode"
    # Prefill resources and args are the pool's own; decode keeps engine.resources.
    assert container(prefill)["resources"]["requests"]["cpu"] == "4"
    assert container(decode)["resources"]["requests"]["cpu"] == "2"
    assert container(prefill)["args"][-2:] == ["--max-num-batched-tokens", "4096"]
    assert "4096" not in container(decode)["args"]
    for obj in (prefill, objs["Service", "m-prefill"]):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "u1"
    # Node drains keep the prefill pool's warm minimum too.
    budget = objs["PodDisruptionBudget", "m-prefill"]["spec"]
    assert budget == {"selector": {"matchLabels": prefill_selector("m")}, "minAvailable": 1}
    monitors = {
        o["metadata"]["name"]: o["spec"]["selector"]["matchLabels"]
        for o in render.children(make(pd=PD), SETTINGS, True)
        if o["kind"] == "ServiceMonitor"
    }
    assert monitors == {"m-engine": engine_selector("m"), "m-prefill": prefill_selector("m")}


def test_the_engine_network_policy_fences_both_pools_and_lets_engines_reach_each_other() -> None:
    policy = objects(make(pd=PD))["NetworkPolicy", "m-engine"]["spec"]
    selector = policy["podSelector"]
    assert selector["matchLabels"] == {"servefleet.io/llmdeployment": "m"}
    (expr,) = selector["matchExpressions"]
    assert expr["values"] == ["engine", "prefill-engine"]
    (rule,) = policy["ingress"]  # ours: only the engine port, peers included
    assert {"podSelector": selector} in rule["from"]


def test_vllm_pools_get_the_nixl_connector_side_channel_and_peer_rule() -> None:
    objs = objects(make("vllm", {"transfer": "nixl"}))
    for name, kv_role in (("m-prefill", "kv_producer"), ("m-engine", "kv_consumer")):
        c = container(objs["Deployment", name])
        config = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == "NixlConnector" and config["kv_role"] == kv_role
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {
            "fieldRef": {"fieldPath": "status.podIP"}
        }
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
        assert {"name": "nixl-side", "containerPort": 5600, "protocol": "TCP"} in c["ports"]
    policy = objs["NetworkPolicy", "m-engine"]["spec"]
    _engine_port, peers = policy["ingress"]
    assert "ports" not in peers  # UCX picks its ports at run time
    assert peers["from"] == [{"podSelector": policy["podSelector"]}]


def test_sglang_prefill_serves_the_bootstrap_port() -> None:
    objs = objects(make("sglang", {"transfer": "mooncake"}))
    prefill, decode = (
        container(objs["Deployment", "m-prefill"]),
        container(objs["Deployment", "m-engine"]),
    )
    for c, role in ((prefill, "prefill"), (decode, "decode")):
        assert c["args"][c["args"].index("--disaggregation-mode") + 1] == role
        assert c["args"][c["args"].index("--disaggregation-transfer-backend") + 1] == "mooncake"
    assert {"name": "pd-bootstrap", "containerPort": 8998, "protocol": "TCP"} in prefill["ports"]
    assert all(p["name"] != "pd-bootstrap" for p in decode["ports"])


def test_the_route_names_the_prefill_service_threshold_and_protocol() -> None:
    for kind, pd in (("servefleet", PD), ("vllm", {"transfer": "nixl"})):
        route = objects(make(kind, pd))["ConfigMap", "m-gateway-route"]
        config = GatewayConfig.model_validate(yaml.safe_load(route["data"][ROUTE_GATEWAY_KEY]))
        (deployment,) = config.deployments
        assert deployment.prefill is not None
        assert deployment.prefill.service is not None
        assert (deployment.prefill.service.namespace, deployment.prefill.service.name) == (
            "ns",
            "m-prefill",
        )
        assert deployment.prefill.protocol == kind
        assert deployment.prefill.threshold == (128 if kind == "servefleet" else 256)
        assert deployment.service is not None and deployment.service.name == "m-engine"


def test_colocated_renders_no_prefill_pool_no_roles_and_no_prefill_route() -> None:
    objs = objects(make())
    assert ("Deployment", "m-prefill") not in objs
    labels = objs["Deployment", "m-engine"]["spec"]["template"]["metadata"]["labels"]
    assert "servefleet.io/role" not in labels
    route = objs["ConfigMap", "m-gateway-route"]["data"][ROUTE_GATEWAY_KEY]
    assert "prefill" not in yaml.safe_load(route)["deployments"][0]


class PoolClient(RecordingClient):
    def __init__(self) -> None:
        super().__init__()
        self.deleted: list[tuple[str, str]] = []

    async def apply(self, obj: dict[str, Any], field_manager: str) -> dict[str, Any]:
        """As the API server: an apply of the spec keeps the status the controller wrote."""
        old = self.objects.get((obj["kind"], obj["metadata"]["name"])) or {}
        applied = await super().apply(obj, field_manager)
        if "status" in old:
            self.objects[obj["kind"], obj["metadata"]["name"]] = {**obj, "status": old["status"]}
        return applied

    async def delete(self, resource: Resource, namespace: str | None, name: str) -> bool:
        self.deleted.append((resource.kind, name))
        return self.objects.pop((resource.kind, name), None) is not None


async def test_reconcile_applies_the_pool_reports_it_and_removes_it_with_the_block() -> None:
    client, events = PoolClient(), list[EventSpec]()
    r = reconciler(client, events)
    await r.reconcile(make(pd=PD))
    applied = [(o["kind"], o["metadata"]["name"]) for o, _ in client.applied]
    assert ("Deployment", "m-prefill") in applied and ("Service", "m-prefill") in applied
    client.objects["Deployment", "m-prefill"]["status"] = {"replicas": 2, "readyReplicas": 1}
    await r.reconcile(make(pd=PD))
    status = client.status_patches[-1]["status"]
    assert status["prefill"] == {"replicas": 2, "desiredReplicas": 2, "readyReplicas": 1}
    assert client.deleted == []

    # The block is deleted: the pool this deployment owns goes, and status forgets it.
    await r.reconcile(make(**status))
    assert sorted(client.deleted) == [
        ("Deployment", "m-prefill"),
        ("PodDisruptionBudget", "m-prefill"),
        ("Service", "m-prefill"),
    ]
    assert client.status_patches[-1]["status"].get("prefill") is None


async def test_a_prefill_named_object_someone_else_owns_is_left_alone() -> None:
    client, events = PoolClient(), list[EventSpec]()
    foreign = {"kind": "Deployment", "metadata": {"name": "m-prefill", "ownerReferences": []}}
    client.objects["Deployment", "m-prefill"] = foreign
    await reconciler(client, events).reconcile(
        make(prefill={"replicas": 1, "desiredReplicas": 1, "readyReplicas": 1})
    )
    assert client.deleted == []
