"""The operator's pure renderers: the children of an LLMDeployment, as dicts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from servefleet.api.conventions import (
    LABEL_DEPLOYMENT,
    LABEL_GATEWAY_ROUTE,
    ROUTE_GATEWAY_KEY,
)
from servefleet.api.engines import ENGINE_ADAPTERS
from servefleet.api.gateway_config import GatewayConfig
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.api.manifests import load_llmdeployments
from servefleet.api.route_signature import signature_matches
from servefleet.operator import render

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = Path(__file__).with_name("test_operator_render_snapshot.yaml")
KEY = b"route-signing-key-for-the-tests"
SETTINGS = render.RenderSettings(
    engine_image="servefleet:test",
    gateway_url="http://gw.servefleet.svc:8080",
    route_signing_key=KEY,
    system_namespace="sf-system",
    metrics_namespaces=("monitoring",),
)


def example() -> LLMDeployment:
    dep = load_llmdeployments(ROOT / "examples" / "llmdeployment.yaml")[0]
    return dep.model_copy(
        update={"metadata": dep.metadata.model_copy(update={"uid": "uid-1", "generation": 1})}
    )


def make(spec: dict[str, Any], name: str = "m1") -> LLMDeployment:
    return LLMDeployment.model_validate(
        {"metadata": {"name": name, "namespace": "ns", "uid": "u"}, "spec": spec}
    )


def by_kind(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objs}


def test_children_match_the_snapshot() -> None:
    objs = render.children(example(), SETTINGS, with_service_monitor=True)
    # gateway.yaml is the gateway's own format (checked against GatewayConfig below);
    # the snapshot pins what the operator decides, not the gateway's defaults.
    objs[0]["data"][ROUTE_GATEWAY_KEY] = "<GatewayConfig fragment>"
    text = yaml.safe_dump_all(objs, sort_keys=True)
    if os.environ.get("SERVEFLEET_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(text)
    assert text == SNAPSHOT.read_text(), (
        "children changed: review, then SERVEFLEET_UPDATE_SNAPSHOTS=1"
    )


def test_every_child_is_owned_by_the_cr_and_labelled() -> None:
    dep = example()
    objs = render.children(dep, SETTINGS, with_service_monitor=True)
    assert [o["kind"] for o in objs] == [
        "ConfigMap",
        "Service",
        "Deployment",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "ServiceMonitor",
    ]
    for obj in objs:
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "servefleet.io/v1alpha1",
            "kind": "LLMDeployment",
            "name": "smollm2",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert obj["metadata"]["namespace"] == "default"
        assert obj["metadata"]["labels"][LABEL_DEPLOYMENT] == "smollm2"
    assert "ServiceMonitor" not in by_kind(
        render.children(dep, SETTINGS, with_service_monitor=False)
    )


def test_rendering_without_uid_is_refused() -> None:
    dep = make(
        {"model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}}}
    ).model_copy()
    dep.metadata.uid = None
    with pytest.raises(ValueError, match="has no uid"):
        render.children(dep, SETTINGS, with_service_monitor=False)


def test_engine_deployment_keeps_the_warm_pool_during_rollouts() -> None:
    deployment = render.engine_deployment(example(), SETTINGS)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    pod = deployment["spec"]["template"]
    assert (
        pod["metadata"]["labels"].items() >= deployment["spec"]["selector"]["matchLabels"].items()
    )
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["servefleet", "engine"]
    assert container["image"] == "servefleet:test"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert (
        container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"]
        >= 900
    )
    assert pod["spec"]["terminationGracePeriodSeconds"] == 30 + render.EXIT_GRACE_SECONDS
    args = container["args"]
    assert args[args.index("--model") + 1] == "smollm2-135m-instruct"
    assert args[args.index("--served-model-name") + 1] == "smollm2-135m-instruct"
    assert args[args.index("--max-num-seqs") + 1] == "16"
    # The engine queues no more than the gateway sends it (pool.perReplicaConcurrency).
    assert args[args.index("--max-queue-depth") + 1] == "8"
    assert "--no-prefix-caching" not in args


def test_replicas_follow_spec_replicas() -> None:
    dep = make(
        {
            "model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}},
            "replicas": 3,
            "pool": {"maxReplicas": 5},
        }
    )
    assert render.engine_deployment(dep, SETTINGS)["spec"]["replicas"] == 3


def test_pvc_source_mounts_the_claim_read_only() -> None:
    dep = make(
        {
            "model": {
                "name": "llama",
                "source": {"pvc": {"claimName": "models", "path": "llama-3-8b"}},
            },
            "engine": {
                "kind": "vllm",
                "tensorParallelSize": 2,
                "resources": {"limits": {"nvidia.com/gpu": 2}},
                "kvCacheMemory": "0.85",
                "prefixCaching": False,
            },
        }
    )
    pod = render.engine_pod_template(dep, SETTINGS)["spec"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in pod["volumes"]
    (container,) = pod["containers"]
    assert container["image"] == ENGINE_ADAPTERS["vllm"].default_image
    args = container["args"]
    assert args[args.index("--model") + 1] == "/models/llama-3-8b"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.85"
    assert "--no-enable-prefix-caching" in args
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_sglang_adapter_flags_and_port() -> None:
    dep = make(
        {
            "model": {"name": "q", "source": {"pvc": {"claimName": "c"}}},
            "engine": {
                "kind": "sglang",
                "maxNumSeqs": 32,
                "args": ["--trust-remote-code"],
                "env": [
                    {"name": "HF_HOME", "value": "/tmp"},
                    {"name": "TOKEN", "secretKeyRef": {"name": "s", "key": "k"}},
                ],
            },
        }
    )
    container = render.engine_pod_template(dep, SETTINGS)["spec"]["containers"][0]
    assert container["ports"][0]["containerPort"] == 30000
    assert container["readinessProbe"]["httpGet"]["path"] == "/health_generate"
    assert container["args"][-1] == "--trust-remote-code"
    assert container["args"][container["args"].index("--max-running-requests") + 1] == "32"
    assert container["env"][-1] == {
        "name": "TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}},
    }
    assert render.headless_service(dep)["spec"]["ports"][0]["port"] == 30000


def test_headless_service_and_pdb() -> None:
    dep = example()
    service = render.headless_service(dep)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == render.selector_labels(dep)
    assert render.pod_disruption_budget(dep)["spec"]["minAvailable"] == 1
    zero = make(
        {
            "model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}},
            "pool": {"minReplicas": 0},
        }
    )
    assert render.pod_disruption_budget(zero)["spec"] == {
        "selector": {"matchLabels": render.selector_labels(zero)},
        "maxUnavailable": 1,
    }


def test_gateway_route_is_a_gateway_config_with_secret_references_only() -> None:
    configmap = render.gateway_route_configmap(example(), KEY)
    assert configmap["metadata"]["labels"][LABEL_GATEWAY_ROUTE] == "true"
    config = GatewayConfig.model_validate(yaml.safe_load(configmap["data"][ROUTE_GATEWAY_KEY]))
    (deployment,) = config.deployments
    assert deployment.model == "smollm2-135m-instruct"
    assert deployment.service is not None
    assert (deployment.service.namespace, deployment.service.name) == ("default", "smollm2-engine")
    assert deployment.pool.max_replicas == 3 and deployment.admission.max_queue_depth == 64
    (tenant,) = config.tenants
    source = tenant.api_keys[0].source
    assert source is not None
    assert source.file == "/etc/servefleet/secrets/default/smollm2-demo-key/api-key"
    assert "sk-servefleet" not in str(configmap)
    assert set(configmap["data"]) == {ROUTE_GATEWAY_KEY}  # engine facts live in api.engines


def test_rendering_is_deterministic() -> None:
    assert render.children(example(), SETTINGS, True) == render.children(example(), SETTINGS, True)


def pod_spec(spec: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = render.engine_pod_template(make(spec), SETTINGS)["spec"]
    return result


GPU_SPEC = {
    "model": {"name": "q", "source": {"pvc": {"claimName": "c"}}, "quantization": "awq"},
    "engine": {
        "kind": "vllm",
        "tensorParallelSize": 2,
        "maxModelLen": 8192,
        "resources": {"limits": {"nvidia.com/gpu": 2}},
    },
}


def test_scheduling_is_copied_into_the_engine_pods() -> None:
    spread = {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
                ]
            }
        }
    }
    pod = pod_spec(
        {
            **GPU_SPEC,
            "scheduling": {
                "nodeSelector": {"pool": "gpu"},
                "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm"}],
                "affinity": affinity,
                "priorityClassName": "serving-high",
                "runtimeClassName": "nvidia",
                "topologySpreadConstraints": [spread],
            },
        }
    )
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "llm"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ]
    assert pod["affinity"] == affinity
    assert (pod["priorityClassName"], pod["runtimeClassName"]) == ("serving-high", "nvidia")
    # Without a labelSelector a spread constraint counts this deployment's engine pods.
    assert pod["topologySpreadConstraints"] == [
        {**spread, "labelSelector": {"matchLabels": render.selector_labels(make(GPU_SPEC))}}
    ]


def test_unset_scheduling_adds_nothing_to_a_cpu_pod() -> None:
    pod = render.engine_pod_template(example(), SETTINGS)["spec"]
    for field in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        assert field not in pod
    assert "runtimeClassName" not in pod and "topologySpreadConstraints" not in pod


@pytest.mark.parametrize(
    ("kind", "length_flag"),
    [("vllm", "--max-model-len"), ("sglang", "--context-length")],
)
def test_quantization_and_max_model_len_reach_vllm_and_sglang(kind: str, length_flag: str) -> None:
    spec = {**GPU_SPEC, "engine": {**GPU_SPEC["engine"], "kind": kind}}
    args = pod_spec(spec)["containers"][0]["args"]
    assert args[args.index("--quantization") + 1] == "awq"
    assert args[args.index(length_flag) + 1] == "8192"
    gguf = {**spec, "model": {**spec["model"], "quantization": "q4_0"}}
    assert "--quantization" not in pod_spec(gguf)["containers"][0]["args"]


def test_max_model_len_reaches_our_engine() -> None:
    spec = {
        "model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}},
        "engine": {"maxModelLen": 1024},
    }
    args = pod_spec(spec)["containers"][0]["args"]
    assert args[args.index("--max-model-len") + 1] == "1024"
    assert "--quantization" not in args


RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
}


@pytest.mark.parametrize("kind", ["servefleet", "vllm", "sglang"])
def test_every_engine_pod_container_runs_non_root_on_a_read_only_root(kind: str) -> None:
    source = (
        {"builtin": "smollm2-135m-instruct"} if kind == "servefleet" else {"url": "https://x/m"}
    )
    pod = pod_spec({"model": {"name": "m", "source": source}, "engine": {"kind": kind}})
    # vLLM's and SGLang's images would run as root: every kind runs as the engine user.
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod["automountServiceAccountToken"] is False
    containers = [*pod["containers"], *pod.get("initContainers", [])]
    assert containers and all(c["securityContext"] == RESTRICTED for c in containers)
    # What engines write goes to the scratch emptyDir: HOME and caches point there.
    assert {"name": "scratch", "emptyDir": {}} in pod["volumes"]
    engine = pod["containers"][0]
    assert {"name": "scratch", "mountPath": "/tmp"} in engine["volumeMounts"]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert (env["HOME"], env["XDG_CACHE_HOME"]) == ("/tmp", "/tmp/.cache")
    for init in pod.get("initContainers", []):
        assert {"name": "scratch", "mountPath": "/tmp"} in init["volumeMounts"] or init[
            "name"
        ] == "scratch-seed"


def test_our_engine_keeps_the_kernels_its_image_ships_under_the_scratch_mount() -> None:
    pod = render.engine_pod_template(example(), SETTINGS)["spec"]
    (seed,) = pod["initContainers"]
    assert seed["name"] == "scratch-seed" and seed["image"] == "servefleet:test"
    assert seed["command"][:2] == ["sh", "-c"] and "/tmp/servefleet" in seed["command"][2]
    assert seed["volumeMounts"] == [{"name": "scratch", "mountPath": "/seed"}]
    assert "initContainers" not in pod_spec(GPU_SPEC)  # vLLM's image ships nothing there


def test_a_user_env_var_wins_over_the_scratch_defaults() -> None:
    spec = {
        "model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}},
        "engine": {"env": [{"name": "HOME", "value": "/tmp/mine"}]},
    }
    env = [e for e in pod_spec(spec)["containers"][0]["env"] if e["name"] == "HOME"]
    assert env == [{"name": "HOME", "value": "/tmp/mine"}]


def test_network_policy_admits_only_the_chart_namespace_and_prometheus_namespaces() -> None:
    dep = example()
    policy = by_kind(render.children(dep, SETTINGS, False))["NetworkPolicy"]
    assert policy["metadata"]["name"] == "smollm2-engine"
    assert policy["spec"]["podSelector"] == {"matchLabels": render.selector_labels(dep)}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    chart_namespace = {"matchLabels": {"kubernetes.io/metadata.name": "sf-system"}}
    gateway, autoscaler, engines, prometheus = rule["from"]
    # A pod that labels itself "gateway" in its own namespace matches no peer: the chart's
    # pods are selected in the chart's namespace only, by the label the API server sets.
    assert gateway == {
        "namespaceSelector": chart_namespace,
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/part-of": "servefleet",
                "app.kubernetes.io/component": "gateway",
            }
        },
    }
    assert autoscaler["namespaceSelector"] == chart_namespace
    assert autoscaler["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "autoscaler"
    # the deployment's own engines (its namespace: no namespaceSelector) pull KV from each other
    assert engines == {"podSelector": {"matchLabels": render.selector_labels(dep)}}
    assert prometheus == {
        "namespaceSelector": {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}
            ]
        }
    }
    assert "engine-client" not in str(policy)
    plain = render.RenderSettings(
        engine_image="x", gateway_url="http://gw", route_signing_key=KEY, system_namespace="s"
    )
    (rule,) = render.engine_network_policy(dep, plain)["spec"]["ingress"]
    assert len(rule["from"]) == 3  # no Prometheus namespace named: none admitted
    vllm = example()
    vllm.spec.engine.kind = "vllm"
    (rule,) = render.engine_network_policy(vllm, plain)["spec"]["ingress"]
    assert len(rule["from"]) == 2  # vLLM engines pull nothing from each other


@pytest.mark.parametrize(
    ("kind", "env_name", "key_args"),
    [
        ("servefleet", "SERVEFLEET_API_KEY", []),
        ("vllm", "VLLM_API_KEY", []),
        ("sglang", "SERVEFLEET_API_KEY", ["--api-key", "$(SERVEFLEET_API_KEY)"]),
    ],
)
def test_engines_require_the_key_from_the_operator_secret(
    kind: str, env_name: str, key_args: list[str]
) -> None:
    source = (
        {"builtin": "smollm2-135m-instruct"} if kind == "servefleet" else {"url": "https://x/m"}
    )
    spec = {"model": {"name": "m", "source": source}, "engine": {"kind": kind, "args": ["--x"]}}
    container = pod_spec(spec)["containers"][0]
    assert container["env"][0] == {
        "name": env_name,
        "valueFrom": {"secretKeyRef": {"name": "m1-engine-key", "key": "api-key"}},
    }
    args = container["args"]
    assert args[-1] == "--x"  # the user's flags still come last
    assert args[len(args) - 1 - len(key_args) : -1] == key_args


def test_engine_key_secret_is_random_and_only_made_when_the_spec_names_none() -> None:
    dep = example()
    first, second = render.engine_key_secret_for(dep), render.engine_key_secret_for(dep)
    assert first is not None and second is not None
    assert first["metadata"]["name"] == "smollm2-engine-key"
    assert first["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert first["data"]["api-key"] != second["data"]["api-key"]
    named = make(
        {
            "model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}},
            "engine": {"apiKeySecretRef": {"name": "mine", "key": "k"}},
        }
    )
    assert render.engine_key_secret_for(named) is None
    env = render.engine_pod_template(named, SETTINGS)["spec"]["containers"][0]["env"]
    assert env[0]["valueFrom"] == {"secretKeyRef": {"name": "mine", "key": "k"}}
    route = yaml.safe_load(render.gateway_route_configmap(named, KEY)["data"][ROUTE_GATEWAY_KEY])
    assert route["deployments"][0]["engine_api_key"] == {
        "file": "/etc/servefleet/secrets/ns/mine/k"
    }


def test_gateway_route_references_the_engine_key_never_its_value() -> None:
    config = GatewayConfig.model_validate(
        yaml.safe_load(render.gateway_route_configmap(example(), KEY)["data"][ROUTE_GATEWAY_KEY])
    )
    key = config.deployments[0].engine_api_key
    assert key is not None
    assert key.file == "/etc/servefleet/secrets/default/smollm2-engine-key/api-key"


def test_the_route_is_signed_over_its_namespace_name_owner_and_data() -> None:
    configmap = render.gateway_route_configmap(example(), KEY)
    meta = configmap["metadata"]
    signature = meta["annotations"]["servefleet.io/route-signature"]
    args = (meta["namespace"], meta["name"], "uid-1", configmap["data"])
    assert signature_matches(KEY, signature, *args)
    assert not signature_matches(b"another-key-another-key", signature, *args)
    assert not signature_matches(KEY, signature, "other-namespace", *args[1:])
    assert not signature_matches(KEY, signature, args[0], args[1], "another-owner", args[3])
    edited = {ROUTE_GATEWAY_KEY: configmap["data"][ROUTE_GATEWAY_KEY] + "\n# more"}
    assert not signature_matches(KEY, signature, *args[:3], edited)
    # Deterministic: re-applying an unchanged spec changes nothing.
    assert render.gateway_route_configmap(example(), KEY) == configmap


def test_a_host_path_cache_mounts_its_allowed_prefix_and_the_rest_as_sub_path() -> None:
    spec = {
        "model": {
            "name": "m",
            "source": {"url": "https://models.example/m.gguf"},
            "cache": {"hostPath": {"path": "/var/cache/servefleet/team-a"}},
        }
    }
    allowed = render.RenderSettings(
        engine_image="servefleet:test",
        gateway_url="http://gw",
        route_signing_key=KEY,
        host_path_prefixes=("/var/cache/servefleet",),
    )
    dep = make(spec)
    assert render.refusal(dep, allowed) is None
    pod = render.engine_pod_template(dep, allowed)["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    # The prefix, never the team's path itself: the kubelet resolves a subPath without
    # following a symbolic link out of the volume.
    assert volume == {
        "name": "model",
        "hostPath": {"path": "/var/cache/servefleet", "type": "Directory"},
    }
    fetch = next(c for c in pod["initContainers"] if c["name"] == "model-fetch")
    mounts = [*fetch["volumeMounts"], *pod["containers"][0]["volumeMounts"]]
    assert [m.get("subPath") for m in mounts if m["name"] == "model"] == ["team-a", "team-a"]
    refused = render.refusal(dep, SETTINGS)  # no prefix allowed: the default
    assert refused is not None and refused.reason == "HostPathNotAllowed"
    assert "/var/cache/servefleet/team-a" in refused.message
    assert "operator.allowedHostPathPrefixes" in refused.message


def test_an_engine_image_outside_the_allow_list_is_refused() -> None:
    def spec(kind: str, image: str | None) -> LLMDeployment:
        source = (
            {"builtin": "smollm2-135m-instruct"} if kind == "servefleet" else {"url": "https://x/m"}
        )
        engine = {"kind": kind, **({"image": image} if image else {})}
        return make({"model": {"name": "m", "source": source}, "engine": engine})

    for kind, image in [
        ("servefleet", None),  # the operator's own image
        ("servefleet", "servefleet:test"),
        ("vllm", None),  # the adapters' default images: allowed by default
        ("sglang", None),
        ("vllm", "docker.io/vllm/vllm-openai:v0.11.0"),
        ("vllm", "vllm/vllm-openai@sha256:" + "a" * 64),
    ]:
        assert render.refusal(spec(kind, image), SETTINGS) is None, (kind, image)
    refused = render.refusal(spec("vllm", "evil.example/miner:1"), SETTINGS)
    assert refused is not None and refused.reason == "ImageNotAllowed"
    assert "evil.example/miner:1" in refused.message and "operator.allowedImages" in refused.message
    # A name that merely starts like an allowed repository is another repository.
    assert render.refusal(spec("vllm", "vllm/vllm-openai-evil:1"), SETTINGS) is not None
