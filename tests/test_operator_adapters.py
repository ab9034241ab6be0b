"""LLMAdapters on Kubernetes, operator side: the `Accepted` condition (each refusal naming
both sides), the route ConfigMap with the accepted ones and the lora_path their engine pods
load them from, and that route surviving the gateway's signature check, Secret resolution
and merge. The adapter config is read from real local servers (a Hub-compatible file API,
moto's S3) in test_operator_adapter_config.py."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest
import yaml
from pydantic import SecretStr

from servefleet.api.conventions import ROUTE_GATEWAY_KEY
from servefleet.api.gateway_config import GatewayConfig, hash_api_key
from servefleet.api.llmadapter import LLMAdapter
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.api.lora import PeftLoraConfig
from servefleet.gateway.route_merge import (
    ResolvedSecrets,
    SecretKeyPath,
    merge_routes,
    parse_route,
    resolve_route,
)
from servefleet.kube import KubeError, ObjectList
from servefleet.kube.resources import Resource
from servefleet.operator import render
from servefleet.operator.adapter_checks import NameClaims, config_verdict, fit_verdict
from servefleet.operator.adapter_config import AdapterConfigReader, ConfigRead
from servefleet.operator.status import EventSpec
from tests.test_operator_reconciler import KEY, RecordingClient, reconciler

NS = "team"
BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
HUB = {"huggingface": {"repo": "acme/support", "endpoint": "http://hub.test"}}
TOKEN = {"name": "platform-secret", "key": "k"}
VLLM = {
    "engine": {"kind": "vllm", "lora": {}},
    "model": {"name": "chat-model", "source": {"huggingface": {"repo": "acme/base"}}},
}


def deployment(name: str = "chat", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name": f"{name}-model", "source": {"builtin": "smollm2-135m-instruct"}},
        "engine": {"lora": {"maxLoraRank": 16}},
        "tenants": [
            {"name": t, "apiKeySecretRef": {"name": f"{t}-key", "key": "api-key"}}
            for t in ("alpha", "beta")
        ],
    }
    for key, value in spec.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1},
        "spec": body,
    }


def adapter(name: str, created: str = "2025-01-01T00:00:00Z", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMAdapter",
        "metadata": {
            "name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1,
            "creationTimestamp": created,
        },
        "spec": {"deployment": "chat", "source": HUB, **spec},
    }  # fmt: skip


def dep_of(body: dict[str, Any]) -> LLMDeployment:
    return LLMDeployment.model_validate(body)


def adapter_of(body: dict[str, Any]) -> LLMAdapter:
    return LLMAdapter.model_validate(body)


def read(**config: Any) -> ConfigRead:
    fields = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]} | config
    return ConfigRead("read", config=PeftLoraConfig.model_validate(fields))


def judge(adapter_body: dict[str, Any], dep_body: dict[str, Any], got: ConfigRead) -> Any:
    dep, one = dep_of(dep_body), adapter_of(adapter_body)
    return config_verdict(one, dep, fit_verdict(one, dep, NameClaims.of([dep])), got)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("adapter_spec", "dep_spec", "got", "reason", "named"),
    [
        ({}, {"engine": {}}, read(), "LoraNotEnabled", ["chat", "engine.lora"]),
        ({"tenants": ["gamma"]}, {}, read(), "UnknownTenants", ["gamma", "alpha, beta"]),
        ({"model": "chat-model"}, {}, read(), "NameConflict", ["chat-model", "chat"]),
        ({}, {}, read(r=32), "AdapterNotServable", ["r 32", "--max-lora-rank 16", "chat"]),
        (
            {}, {}, read(target_modules=["lm_head"]),
            "AdapterNotServable", ["lm_head", "q_proj"],
        ),
        (
            {}, {}, read(base_model_name_or_path="meta-llama/Llama-3.1-8B"),
            "BaseModelMismatch", ["meta-llama/Llama-3.1-8B", "chat-model", "smollm2-135m-instruct"],
        ),
        (
            {"source": {"huggingface": {"repo": "acme/x", "tokenSecretRef": TOKEN}}},
            {}, read(), "CredentialsNotSupported", ["tokenSecretRef", "no credentials"],
        ),
        (
            {"source": {"s3": {"url": "s3://bucket/a/", "credentialsSecret": "aws"}}},
            {}, read(), "CredentialsNotSupported", ["credentialsSecret"],
        ),
        (
            {"source": {"s3": {"url": "s3://bucket/a/file.json"}}},
            {}, read(), "SourceNotSupported", ["s3://bucket/a/file.json", "folder"],
        ),
        (
            {"source": {"oci": {"reference": "registry.test/adapters/a:1"}}},
            VLLM, read(), "SourceNotSupported", ["source.oci", "vllm"],
        ),
        (
            {"source": {"url": "https://files.test/a.tgz"}},
            VLLM, read(), "SourceNotSupported", ["source.url", "vllm"],
        ),
        (
            {"source": {"oci": {"reference": "reg.test/a:1", "pullPolicy": "Always"}}},
            {}, read(), "SourceNotSupported", ["pullPolicy Always", "pin a digest"],
        ),
        (
            {"source": {"pvc": {"claimName": "adapters", "path": "a"}}},
            {"model": {"name": "m", "source": {"pvc": {"claimName": "weights"}}}},
            read(), "SourceNotMounted", ["adapters", "weights"],
        ),
        (
            {"source": {"huggingface": {"repo": "acme/a", "allowPatterns": ["*.bin"]}}},
            {}, read(), "SourceNotSupported", ["allowPatterns", "adapter_config.json"],
        ),
        (
            {"source": {"huggingface": {"repo": "acme/a", "revision": "v2"}}},
            VLLM, read(), "SourceNotSupported", ["vllm", "acme/a@v2"],
        ),
        (
            {"source": {"s3": {"url": "s3://bucket/a/"}}},
            VLLM, read(), "SourceNotSupported", ["vllm", "S3"],
        ),
        (
            {}, {}, ConfigRead("refused", "adapter_config.json at x: not found (HTTP 404)",
                               reason="AdapterConfigNotFound"),
            "AdapterConfigNotFound", ["HTTP 404"],
        ),
    ],
)  # fmt: skip
def test_each_refusal_names_what_is_wrong_on_both_sides(
    adapter_spec: dict[str, Any],
    dep_spec: dict[str, Any],
    got: ConfigRead,
    reason: str,
    named: list[str],
) -> None:
    verdict = judge(adapter("a", **adapter_spec), deployment(**dep_spec), got)
    assert (verdict.status, verdict.reason) == ("False", reason), verdict.message
    for part in named:
        assert part in verdict.message, (part, verdict.message)


def test_a_fitting_adapter_is_accepted_with_its_config() -> None:
    # Trained on the Hub model a built-in is made from: the same model.
    verdict = judge(adapter("a"), deployment(), read(base_model_name_or_path=BASE))
    assert (verdict.status, verdict.reason) == ("True", "Accepted")
    assert "model a" in verdict.message and "rank 8" in verdict.message
    # A PVC the engine pods already mount: accepted, its config left to the engine.
    on_claim: dict[str, Any] = {"source": {"pvc": {"claimName": "cache", "path": "adapters/a"}}}
    cached: dict[str, Any] = {
        "model": {
            "name": "m",
            "source": {"huggingface": {"repo": "acme/base"}},
            "cache": {"pvc": {"claimName": "cache"}},
        }
    }
    unchecked = ConfigRead("unchecked", "source.pvc cannot be read by the operator: checked ...")
    verdict = judge(adapter("a", **on_claim), deployment(**cached), unchecked)
    assert verdict.status == "True" and "cannot be read by the operator" in verdict.message


@pytest.mark.parametrize(
    ("source", "dep_spec", "path"),
    [
        (HUB, {}, "hf://acme/support@main?endpoint=http%3A%2F%2Fhub.test"),
        ({"s3": {"url": "s3://bkt/a b/", "region": "eu-1"}}, {}, "s3://bkt/a%20b/?region=eu-1"),
        ({"url": "https://files.test/a.tgz?v=2"}, {}, "https://files.test/a.tgz?v=2"),
        ({"oci": {"reference": "reg.test/a:1"}}, {}, "oci://reg.test/a:1"),
        ({"oci": {"reference": "reg.test/a:1", "path": "m/a"}}, {}, "oci://reg.test/a:1?path=m%2Fa"),
        ({"huggingface": {"repo": "acme/a"}}, VLLM, "acme/a"),  # vLLM fetches a Hub id itself
        (
            {"huggingface": {"repo": "acme/a", "endpoint": "http://mirror.test/"}},
            {**VLLM, "engine": {"kind": "vllm", "lora": {},
                                "env": [{"name": "HF_ENDPOINT", "value": "http://mirror.test"}]}},
            "acme/a",
        ),
        (
            {"pvc": {"claimName": "weights", "path": "adapters/a"}},
            {"model": {"name": "m", "source": {"pvc": {"claimName": "weights", "path": "m"}}}},
            "/models/adapters/a",
        ),
    ],
)  # fmt: skip
def test_the_route_names_where_the_engine_pods_load_an_adapter_from(
    source: dict[str, Any], dep_spec: dict[str, Any], path: str
) -> None:
    dep = dep_of(deployment(**dep_spec))
    one = adapter_of(adapter("a", source=source))
    assert fit_verdict(one, dep, NameClaims.of([dep])).accepted
    fragment = render.gateway_config(dep, [one])
    assert fragment["deployments"][0]["adapters"][0]["path"] == path


def test_a_served_name_goes_to_the_oldest_adapter_and_tenants_scope_other_deployments() -> None:
    chat, other = dep_of(deployment()), dep_of(deployment("other"))
    claims = NameClaims.of([chat, other])
    first, second = (
        adapter_of(adapter("first", model="bot")),
        adapter_of(adapter("second", model="bot")),
    )
    assert fit_verdict(first, chat, claims).accepted
    claims.claim(first, chat)
    again = fit_verdict(second, chat, claims)
    assert again.reason == "NameConflict" and "LLMAdapter first" in again.message
    # Another deployment of the namespace: a conflict only for a tenant both would serve.
    elsewhere = adapter_of(adapter("third", model="bot", deployment="other", tenants=["beta"]))
    clash = fit_verdict(elsewhere, other, claims)
    assert clash.reason == "NameConflict" and "beta" in clash.message and "chat" in clash.message
    taken = adapter_of(adapter("fourth", model="chat-model", deployment="other"))
    assert "LLMDeployment chat" in fit_verdict(taken, other, claims).message
    alone = dep_of(deployment("solo", tenants=[]))
    free = adapter_of(adapter("fifth", model="bot", deployment="solo"))
    assert fit_verdict(free, alone, claims).accepted  # no tenant in common: no clash


def test_a_transient_read_keeps_an_accepted_adapter_accepted() -> None:
    retry = ConfigRead("retry", "adapter_config.json at x: ConnectError: refused")
    fresh = judge(adapter("a"), deployment(), retry)
    assert (fresh.status, fresh.reason) == ("Unknown", "AdapterConfigUnavailable")
    accepted = adapter("a")
    accepted["status"] = {
        "conditions": [
            {"type": "Accepted", "status": "True", "reason": "Accepted", "message": "ok",
             "observedGeneration": 1},
        ]
    }  # fmt: skip
    assert judge(accepted, deployment(), retry).status == "True"
    accepted["metadata"]["generation"] = 2  # a new spec must be read first
    assert judge(accepted, deployment(), retry).status == "Unknown"


# --------------------------------------------------------------------------- the reconcile


class Cluster(RecordingClient):
    """The RecordingClient with LLMAdapters and LLMDeployments to list and statuses to keep."""

    def __init__(self, deployments: list[dict[str, Any]], adapters: list[dict[str, Any]]) -> None:
        super().__init__()
        self.deployments = deployments
        self.adapters = adapters
        self.adapter_patches: list[tuple[str, dict[str, Any]]] = []
        for body in deployments:
            self.objects[("LLMDeployment", body["metadata"]["name"])] = body

    async def list(
        self, resource: Resource, namespace: str | None, label_selector: str | None = None
    ) -> ObjectList:
        assert namespace in (NS, None)
        listed = {"LLMAdapter": self.adapters, "LLMDeployment": self.deployments}
        return ObjectList(items=copy.deepcopy(listed.get(resource.kind, [])))

    async def patch_status(
        self, resource: Resource, namespace: str, name: str, patch: dict[str, Any], manager: str
    ) -> dict[str, Any]:
        if resource.kind == "LLMDeployment":
            return await super().patch_status(resource, namespace, name, patch, manager)
        assert (resource.kind, manager) == ("LLMAdapter", "servefleet-operator")
        self.adapter_patches.append((name, copy.deepcopy(patch)))
        body = next(a for a in self.adapters if a["metadata"]["name"] == name)
        status = {**body.get("status", {}), **patch["status"]}  # a merge patch: null removes
        body["status"] = {k: v for k, v in status.items() if v is not None}
        return patch


def hub_config(request: httpx.Request) -> httpx.Response:
    """The adapters' configs, as a Hub would answer them."""
    configs = {
        "acme/support": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                         "base_model_name_or_path": BASE},
        "acme/too-big": {"r": 64, "lora_alpha": 16, "target_modules": ["q_proj"]},
    }  # fmt: skip
    repo = request.url.path.split("/resolve/")[0].strip("/")
    found = configs.get(repo)
    return httpx.Response(200, json=found) if found else httpx.Response(404)


def routed(client: Cluster) -> GatewayConfig:
    route = client.objects[("ConfigMap", "chat-gateway-route")]
    return GatewayConfig.model_validate(yaml.safe_load(route["data"][ROUTE_GATEWAY_KEY]))


async def test_accepted_adapters_are_routed_and_refused_ones_are_not() -> None:
    big = {"source": {"huggingface": {"repo": "acme/too-big", "endpoint": "http://hub.test"}}}
    adapters = [
        adapter("support", tenants=["alpha"]),
        adapter("too-big", "2025-01-02T00:00:00Z", **big),
        adapter("orphan", deployment="gone"),
    ]
    client, events = Cluster([deployment()], adapters), list[EventSpec]()
    r = reconciler(client, events)
    r.adapters.reader = AdapterConfigReader(transport=httpx.MockTransport(hub_config))
    await r.repair(NS, "chat")

    (served,) = routed(client).deployments[0].adapters
    assert served.name == "support" and served.tenants == ["alpha"]
    assert served.path == "hf://acme/support@main?endpoint=http%3A%2F%2Fhub.test"
    statuses = {name: patch["status"] for name, patch in client.adapter_patches}
    accepted = statuses["support"]
    assert accepted["conditions"][0]["status"] == "True"
    assert (accepted["baseModel"], accepted["rank"]) == ("chat-model", 8)
    assert accepted["targetModules"] == ["q_proj", "v_proj"]
    refused = statuses["too-big"]["conditions"][0]
    assert refused["reason"] == "AdapterNotServable" and "r 64" in refused["message"]
    orphan = statuses["orphan"]["conditions"][0]
    assert orphan["reason"] == "DeploymentNotFound" and "gone" in orphan["message"]
    assert ("Warning", "AdapterNotServable") in [(e.type, e.reason) for e in events]

    # Nothing changed: no adapter status is written again, no adapter Event, the same route.
    def adapter_events() -> list[EventSpec]:
        return [e for e in events if e.message.startswith("Accepted=")]

    patches, route, seen = len(client.adapter_patches), routed(client), adapter_events()
    assert len(seen) == 3
    await r.repair(NS, "chat")
    assert len(client.adapter_patches) == patches and routed(client) == route
    assert adapter_events() == seen


async def test_an_adapter_whose_deployment_is_deleted_is_refused() -> None:
    client = Cluster([deployment()], [adapter("support")])
    r = reconciler(client, [])
    r.adapters.reader = AdapterConfigReader(transport=httpx.MockTransport(hub_config))
    await r.repair(NS, "chat")
    client.deployments.clear()
    del client.objects[("LLMDeployment", "chat")]
    assert client.adapters[0]["status"]["rank"] == 8
    client.adapters[0]["status"]["loadedReplicas"] = ["chat-engine-0"]  # the gateway's
    await r.repair(NS, "chat")  # what the DELETED event handler calls
    condition = client.adapters[0]["status"]["conditions"][0]
    assert (condition["status"], condition["reason"]) == ("False", "DeploymentNotFound")
    # A merge patch: the config's fields are removed (null), others' fields left alone.
    (_, patch) = client.adapter_patches[-1]
    assert patch["status"]["rank"] is None and patch["status"]["targetModules"] == []
    assert "loadedReplicas" not in patch["status"]


LOADED = {"type": "Loaded", "status": "True", "reason": "Loaded", "message": "held by 1"}


class Crossed(Cluster):
    """The autoscaler wrote `Loaded` between the operator's list and its status patch: the
    API server holds resourceVersion 2 and refuses a patch made on 1 (409)."""

    def __init__(self) -> None:
        listed = adapter("support")
        listed["metadata"]["resourceVersion"] = "1"
        super().__init__([deployment()], [listed])
        self.current = copy.deepcopy(listed)
        self.current["metadata"]["resourceVersion"] = "2"
        self.current["status"] = {"loadedReplicas": ["chat-engine-0"], "conditions": [LOADED]}
        self.objects[("LLMAdapter", "support")] = self.current
        self.refused: list[dict[str, Any]] = []

    async def patch_status(
        self, resource: Resource, namespace: str, name: str, patch: dict[str, Any], manager: str
    ) -> dict[str, Any]:
        if resource.kind == "LLMAdapter" and patch["metadata"]["resourceVersion"] != "2":
            self.refused.append(patch)
            raise KubeError(409, "the object has been modified; please apply your changes")
        return await super().patch_status(resource, namespace, name, patch, manager)


async def test_a_status_write_crossing_the_autoscalers_is_redone_on_the_new_version() -> None:
    """`conditions` is written whole: a patch made on the version listed would drop the
    autoscaler's `Loaded`; it is refused instead, and written again on the current one."""
    client, events = Crossed(), list[EventSpec]()
    r = reconciler(client, events)
    r.adapters.reader = AdapterConfigReader(transport=httpx.MockTransport(hub_config))
    await r.repair(NS, "chat")
    assert [p["metadata"] for p in client.refused] == [{"resourceVersion": "1"}]
    ((_, patch),) = client.adapter_patches
    assert patch["metadata"] == {"resourceVersion": "2"}
    conditions = {c["type"]: c for c in patch["status"]["conditions"]}
    assert conditions["Loaded"] == LOADED  # the autoscaler's, kept
    assert conditions["Accepted"]["status"] == "True"
    assert [e.reason for e in events if e.message.startswith("Accepted=")] == ["Accepted"]


# --------------------------------------------------------------------------- the gateway


def test_a_route_without_adapters_is_the_same_as_before_adapters_existed() -> None:
    """Same bytes, same signature: an upgrade re-signs nothing, and a gateway not yet
    upgraded (which forbids unknown keys) keeps serving it."""
    fragment = yaml.safe_load(
        render.gateway_route_configmap(dep_of(deployment()), b"k")["data"][ROUTE_GATEWAY_KEY]
    )
    assert "adapters" not in fragment["deployments"][0]


def test_the_routes_adapters_survive_signature_resolution_and_merge() -> None:
    """The gateway scopes a route's tenants `<namespace>/<name>`: an adapter's must follow,
    and one whose only tenant has no key yet serves nobody (never everybody)."""
    dep = dep_of(deployment())
    adapters = [
        adapter_of(adapter("support", tenants=["alpha"])),
        adapter_of(adapter("beta-only", tenants=["beta"])),
        adapter_of(adapter("everyone")),
    ]
    configmap = render.gateway_route_configmap(dep, KEY.get_secret_value(), adapters)
    route = parse_route(configmap, KEY.get_secret_value())
    alpha = SecretKeyPath(NS, "alpha-key", "api-key")
    engine_key = SecretKeyPath(NS, "chat-engine-key", "api-key")
    secrets = ResolvedSecrets(digests={alpha: hash_api_key("sk-alpha")})
    secrets.values[engine_key] = SecretStr("engine")
    resolved, _ = resolve_route(route, secrets)
    merged = merge_routes(GatewayConfig(), [(route, resolved)])
    assert merged.rejected == {} and merged.served == [route.id]
    (served,) = merged.config.deployments
    tenants = {a.name: a.tenants for a in served.adapters}
    assert tenants == {"support": ["team/alpha"], "beta-only": [], "everyone": None}
    assert [t.name for t in served.adapter_tenants(served.adapters[2])] == ["team/alpha"]
