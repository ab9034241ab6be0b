"""The chart rendered by the real helm: defaults, every values knob, the schema, the guards.

Only `helm lint` and `helm template` (no cluster), so it is fast; the rendered chart applied
to a real API server is in test_operator_e2e.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "servefleet"
RELEASE = "servefleet"
NAMESPACE = "servefleet"
COMPONENTS = ("operator", "gateway", "autoscaler", "redis")
# Control-plane CPU requested by default: leaves a two-core node room for the API server
# and engine pods.
SMALL_NODE_CPU_MILLICORES = 250

Objects = list[dict[str, Any]]


def run_helm(
    helm: Path, *args: str, values: dict[str, Any] | None = None
) -> subprocess.CompletedProcess[str]:
    """helm with `values` as a values file on stdin (`-f -`), the way a user passes them."""
    extra = ["--values", "-"] if values is not None else []
    return subprocess.run(
        [str(helm), *args, *extra],
        input=yaml.safe_dump(values) if values is not None else None,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def render(helm: Path, values: dict[str, Any] | None = None) -> Objects:
    """`helm template` with `values`; fails the test on a helm error."""
    done = run_helm(helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, values=values)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def render_error(helm: Path, values: dict[str, Any]) -> str:
    """The error of a `helm template` that must fail."""
    done = run_helm(helm, "template", RELEASE, str(CHART), values=values)
    assert done.returncode != 0, f"rendered although it must not: {values}"
    return done.stderr


def find(objects: Objects, kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def pod_spec(objects: Objects, component: str) -> dict[str, Any]:
    spec: dict[str, Any] = find(objects, "Deployment", f"{RELEASE}-{component}")["spec"]
    return spec


def millicores(cpu: str) -> int:
    return int(cpu[:-1]) if cpu.endswith("m") else int(float(cpu) * 1000)


def test_chart_lints_strictly_with_defaults_and_with_every_knob(helm: Path) -> None:
    for values in (None, KNOBS):
        done = run_helm(helm, "lint", str(CHART), "--strict", values=values)
        assert done.returncode == 0 and "0 chart(s) failed" in done.stdout, done.stdout


def test_defaults_are_safe_and_fit_a_small_node(helm: Path) -> None:
    objects = render(helm)
    kinds = {o["kind"] for o in objects}
    assert "Ingress" not in kinds and "HTTPRoute" not in kinds
    gateway = pod_spec(objects, "gateway")
    assert gateway["replicas"] == 1  # no Redis: one replica, so limits are not multiplied
    assert not any(o["metadata"]["name"] == f"{RELEASE}-redis" for o in objects)
    cpu = 0
    for component in ("operator", "gateway", "autoscaler"):
        pod = pod_spec(objects, component)["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert "nodeSelector" not in pod and "tolerations" not in pod and "affinity" not in pod
        container = pod["containers"][0]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert container["resources"]["limits"]["memory"], component
        cpu += millicores(container["resources"]["requests"]["cpu"])
    assert cpu <= SMALL_NODE_CPU_MILLICORES, f"{cpu}m requested by the control plane"


def component_knobs(component: str) -> dict[str, Any]:
    """A distinct value of every pod knob for one component, so leaks between them show."""
    return {
        "nodeSelector": {"pool": f"{component}-nodes"},
        "tolerations": [{"key": f"{component}-only", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "zone", "operator": "In", "values": [component]}
                            ]
                        }
                    ]
                }
            }
        },
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/component": component}},
            }
        ],
        "priorityClassName": f"{component}-critical",
        "imagePullSecrets": [{"name": f"{component}-registry"}],
        "podAnnotations": {"example.com/owner": component},
        # Tries to move the pod out of its Deployment's selector: must not win.
        "podLabels": {"team": component, "app.kubernetes.io/component": "hijacked"},
        "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 20000, "fsGroup": 20000},
        "securityContext": {"readOnlyRootFilesystem": True, "privileged": False},
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    }


KNOBS: dict[str, Any] = {
    "imagePullSecrets": [{"name": "shared-registry"}],
    "redis": {"enabled": True, **component_knobs("redis")},
    **{c: component_knobs(c) for c in ("operator", "gateway", "autoscaler")},
}
KNOBS["gateway"]["batch"] = {"enabled": True, "persistence": {"enabled": True, "size": "1Gi"}}


@pytest.mark.parametrize("component", COMPONENTS)
def test_each_component_takes_its_own_pod_knobs(helm: Path, component: str) -> None:
    knobs = component_knobs(component)
    deployment = pod_spec(render(helm, KNOBS), component)
    template = deployment["template"]
    pod = template["spec"]
    for key in (
        "nodeSelector",
        "tolerations",
        "affinity",
        "topologySpreadConstraints",
        "priorityClassName",
    ):
        assert pod[key] == knobs[key], key
    assert pod["imagePullSecrets"] == [{"name": "shared-registry"}, *knobs["imagePullSecrets"]]
    assert pod["securityContext"] == {
        **knobs["podSecurityContext"],
        "seccompProfile": {"type": "RuntimeDefault"},  # defaults merge under the knob
    }
    container = pod["containers"][0]
    assert container["resources"] == knobs["resources"]
    assert container["securityContext"]["privileged"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert template["metadata"]["annotations"]["example.com/owner"] == component
    labels = template["metadata"]["labels"]
    assert labels["team"] == component
    assert labels["app.kubernetes.io/component"] == component
    selector = deployment["selector"]["matchLabels"]
    assert selector.items() <= labels.items()


def test_gateway_pods_roll_when_their_config_changes(helm: Path) -> None:
    def checksum(values: dict[str, Any]) -> str:
        template = pod_spec(render(helm, values), "gateway")["template"]
        value: str = template["metadata"]["annotations"]["checksum/config"]
        return value

    plain = checksum({})
    assert checksum({"redis": {"url": "redis://redis.example:6379/0"}}) != plain
    assert checksum({"gateway": {"config": {"affinity_blocks": 4}}}) != plain
    annotated = pod_spec(render(helm, {"gateway": {"podAnnotations": {"a": "b"}}}), "gateway")
    assert annotated["template"]["metadata"]["annotations"]["checksum/config"] == plain


def test_more_gateway_replicas_need_redis(helm: Path) -> None:
    error = render_error(helm, {"gateway": {"replicas": 2}})
    assert "gateway.replicas=2 needs Redis" in error
    for redis in ({"enabled": True}, {"url": "redis://redis.example:6379/0"}):
        objects = render(helm, {"gateway": {"replicas": 2}, "redis": redis})
        assert pod_spec(objects, "gateway")["replicas"] == 2
        config_map = find(objects, "ConfigMap", f"{RELEASE}-gateway")
        config = yaml.safe_load(config_map["data"]["gateway.yaml"])
        assert config["redis"]["gateway_replicas"] == 2  # each replica's share if Redis fails
        assert config["redis"]["url"].startswith("redis://")


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"gatway": {"replicas": 1}}, "'gatway' not allowed"),
        ({"gateway": {"replica": 2}}, "'replica' not allowed"),
        ({"gateway": {"ingress": {"host": "a.example"}}}, "'host' not allowed"),
        ({"gateway": {"resources": {"request": {"cpu": "1"}}}}, "'request' not allowed"),
        ({"operator": {"nodeselector": {"a": "b"}}}, "'nodeselector' not allowed"),
        ({"redis": {"enable": True}}, "'enable' not allowed"),
        ({"metrics": {"serviceMonitor": {"enable": True}}}, "'enable' not allowed"),
        ({"gateway": {"replicas": "2"}}, "/gateway/replicas"),
        ({"gateway": {"port": 0}}, "/gateway/port"),
        ({"autoscaler": {"tolerations": {"key": "x"}}}, "/autoscaler/tolerations"),
        ({"operator": {"logLevel": "verbose"}}, "/operator/logLevel"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ],
)
def test_a_typo_in_values_fails_instead_of_rendering(
    helm: Path, values: dict[str, Any], complaint: str
) -> None:
    error = render_error(helm, values)
    assert "schema" in error and complaint in error, error


def test_ingress_exposes_only_the_tenant_api(helm: Path) -> None:
    ingress_values = {
        "enabled": True,
        "className": "nginx",
        "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"},
        "hosts": ["llm.example.com", "api.example.com"],
        "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}],
    }
    objects = render(helm, {"gateway": {"ingress": ingress_values}})
    ingress = find(objects, "Ingress", f"{RELEASE}-gateway")
    assert ingress["metadata"]["annotations"] == ingress_values["annotations"]
    spec = ingress["spec"]
    assert spec["ingressClassName"] == "nginx"
    assert spec["tls"] == ingress_values["tls"]
    assert [rule["host"] for rule in spec["rules"]] == ingress_values["hosts"]
    service = find(objects, "Service", f"{RELEASE}-gateway")
    port_names = {port["name"] for port in service["spec"]["ports"]}
    for rule in spec["rules"]:
        [path] = rule["http"]["paths"]
        assert (path["path"], path["pathType"]) == ("/v1", "Prefix")
        backend = path["backend"]["service"]
        assert backend["name"] == service["metadata"]["name"]
        assert backend["port"]["name"] in port_names
    any_host = find(
        render(helm, {"gateway": {"ingress": {"enabled": True}}}),
        "Ingress",
        ingress["metadata"]["name"],
    )
    assert [set(rule) for rule in any_host["spec"]["rules"]] == [{"http"}]


def test_httproute_attaches_the_tenant_api_to_a_gateway(helm: Path) -> None:
    parent = {"name": "public", "namespace": "gateway-system", "sectionName": "https"}
    route_values = {"enabled": True, "parentRefs": [parent], "hostnames": ["llm.example.com"]}
    objects = render(helm, {"gateway": {"httpRoute": route_values, "port": 9000}})
    route = find(objects, "HTTPRoute", f"{RELEASE}-gateway")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [parent]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    [rule] = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    service = find(objects, "Service", f"{RELEASE}-gateway")
    assert rule["backendRefs"] == [{"name": service["metadata"]["name"], "port": 9000}]
    assert service["spec"]["ports"][0]["port"] == 9000
    error = render_error(helm, {"gateway": {"httpRoute": {"enabled": True}}})
    assert "needs gateway.httpRoute.parentRefs" in error


# ----------------------------------------------------------------------------- issue 23


def by_kind(objects: Objects, kind: str) -> Objects:
    return [o for o in objects if o["kind"] == kind]


def args_of(objects: Objects, component: str) -> list[str]:
    args: list[str] = pod_spec(objects, component)["template"]["spec"]["containers"][0]["args"]
    return args


def test_rbac_is_namespaced_by_default_and_cluster_wide_only_on_request(helm: Path) -> None:
    objects = render(helm)
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
    roles = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in by_kind(objects, "Role")}
    assert roles == {
        (NAMESPACE, f"{RELEASE}-operator"),
        (NAMESPACE, f"{RELEASE}-gateway"),
        (NAMESPACE, f"{RELEASE}-autoscaler"),
        (NAMESPACE, f"{RELEASE}-autoscaler-gateways"),
    }
    # Every component watches what it is bound in: the release namespace.
    assert f"--namespace={NAMESPACE}" in args_of(objects, "operator")
    assert f"--kube-namespace={NAMESPACE}" in args_of(objects, "gateway")
    assert f"--namespace={NAMESPACE}" in args_of(objects, "autoscaler")

    teams = render(helm, {"operator": {"watchNamespaces": ["team-a", "team-b"]}})
    bound = {
        (o["metadata"]["namespace"], o["roleRef"]["name"]) for o in by_kind(teams, "RoleBinding")
    }
    for team in ("team-a", "team-b"):
        for component in ("operator", "gateway", "autoscaler"):
            assert (team, f"{RELEASE}-{component}") in bound
    assert "--namespace=team-b" in args_of(teams, "operator")

    wide = render(helm, {"rbac": {"clusterWide": True}})
    assert {o["metadata"]["name"] for o in by_kind(wide, "ClusterRoleBinding")} == {
        f"{RELEASE}-{c}" for c in ("operator", "gateway", "autoscaler")
    }
    assert not any(a.startswith("--namespace=") for a in args_of(wide, "operator"))  # all


def rules(objects: Objects, name: str) -> list[dict[str, Any]]:
    role = next(o for o in by_kind(objects, "Role") if o["metadata"]["name"] == name)
    found: list[dict[str, Any]] = role["rules"]
    return found


def test_the_autoscaler_may_not_patch_pods(helm: Path) -> None:
    objects = render(helm)
    autoscaler = rules(objects, f"{RELEASE}-autoscaler")
    assert {v for r in autoscaler if "pods" in r["resources"] for v in r["verbs"]} == {"list"}
    gateway = rules(objects, f"{RELEASE}-gateway")
    assert {v for r in gateway if "secrets" in r["resources"] for v in r["verbs"]} == {"get"}


def mounted_secrets(objects: Objects, component: str) -> set[str]:
    pod = pod_spec(objects, component)["template"]["spec"]
    return {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}


def test_generated_keys_are_secrets_mounted_where_they_are_needed(helm: Path) -> None:
    objects = render(
        helm, {"redis": {"enabled": True}, "metrics": {"serviceMonitor": {"enabled": True}}}
    )
    secrets = {o["metadata"]["name"]: o for o in by_kind(objects, "Secret")}
    internal, signing, redis = (
        f"{RELEASE}-internal",
        f"{RELEASE}-route-signing",
        f"{RELEASE}-redis",
    )
    assert set(secrets) == {internal, signing, redis}
    assert set(secrets[internal]["data"]) == {"internal-api-key"}
    assert mounted_secrets(objects, "gateway") == {internal, signing, redis}
    assert mounted_secrets(objects, "autoscaler") == {internal}
    assert mounted_secrets(objects, "operator") == {signing}
    assert "--internal-api-key-file=/etc/servefleet/internal/internal-api-key" in args_of(
        objects, "autoscaler"
    )
    gateway_args = args_of(objects, "gateway")
    assert (
        "--route-signing-key-file=/etc/servefleet/route-signing/route-signing-key" in gateway_args
    )
    assert "--route-signing-key-file=/etc/servefleet/route-signing/route-signing-key" in args_of(
        objects, "operator"
    )
    # Redis has a password; the gateway reads it from a file, never from its ConfigMap.
    redis_container = pod_spec(objects, "redis")["template"]["spec"]["containers"][0]
    assert redis_container["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert redis_container["env"][0]["valueFrom"]["secretKeyRef"]["name"] == redis
    config_map = find(objects, "ConfigMap", f"{RELEASE}-gateway")
    config = yaml.safe_load(config_map["data"]["gateway.yaml"])
    assert config["redis"]["password"] == {"file": "/etc/servefleet/redis/password"}
    for value in (s["data"][k] for s in secrets.values() for k in s["data"]):
        assert value not in yaml.safe_dump(config_map)
    # Prometheus scrapes the gateway's internal port with the key.
    monitor = find(objects, "ServiceMonitor", f"{RELEASE}-gateway")
    assert monitor["spec"]["endpoints"][0]["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": internal, "key": "internal-api-key"},
    }


def test_admin_allow_lists_reach_the_operator_and_the_gateway(helm: Path) -> None:
    values = {
        "operator": {
            "allowedImages": ["registry.example.com/llm/*"],
            "allowedHostPathPrefixes": ["/var/cache/servefleet"],
        },
        "metrics": {"prometheusNamespaces": ["monitoring"]},
        "gateway": {"spilloverAllowedHosts": ["llm.corp", "10.1.0.0/16"]},
    }
    objects = render(helm, values)
    operator = args_of(objects, "operator")
    assert [a for a in operator if a.startswith("--allowed-image=")] == [
        "--allowed-image=ghcr.io/servefleet/servefleet-engine",  # the chart's engine image
        "--allowed-image=registry.example.com/llm/*",
    ]
    assert "--allowed-host-path-prefix=/var/cache/servefleet" in operator
    assert "--metrics-namespace=monitoring" in operator
    assert f"--system-namespace={NAMESPACE}" in operator
    config = yaml.safe_load(
        find(objects, "ConfigMap", f"{RELEASE}-gateway")["data"]["gateway.yaml"]
    )
    assert config["spillover_allowed_hosts"] == ["llm.corp", "10.1.0.0/16"]
    defaults = args_of(render(helm), "operator")
    assert not any(a.startswith("--allowed-host-path-prefix") for a in defaults)
    assert "--allowed-image=docker.io/vllm/vllm-openai" in defaults


def policies(objects: Objects) -> dict[str, dict[str, Any]]:
    return {
        o["metadata"]["name"].removeprefix(f"{RELEASE}-"): o["spec"]
        for o in by_kind(objects, "NetworkPolicy")
    }


def test_network_policies_admit_only_the_chart_and_named_namespaces(helm: Path) -> None:
    objects = render(
        helm, {"redis": {"enabled": True}, "metrics": {"prometheusNamespaces": ["mon"]}}
    )
    found = policies(objects)
    assert set(found) == {"gateway", "autoscaler", "redis"}
    selector = {"app.kubernetes.io/instance": RELEASE}
    gateway = found["gateway"]
    assert gateway["podSelector"]["matchLabels"] == {
        **selector,
        "app.kubernetes.io/component": "gateway",
    }
    tenant, internal = gateway["ingress"]
    assert tenant == {"ports": [{"port": "http", "protocol": "TCP"}]}  # from anywhere
    assert internal["ports"] == [{"port": "internal", "protocol": "TCP"}]
    prometheus = {
        "namespaceSelector": {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["mon"]}
            ]
        }
    }
    assert internal["from"] == [
        {"podSelector": {"matchLabels": {**selector, "app.kubernetes.io/component": "autoscaler"}}},
        prometheus,
    ]
    (redis,) = found["redis"]["ingress"]
    assert redis["from"] == [
        {"podSelector": {"matchLabels": {**selector, "app.kubernetes.io/component": "gateway"}}}
    ]
    assert found["autoscaler"]["ingress"] == [
        {"from": [prometheus], "ports": [{"port": "metrics", "protocol": "TCP"}]}
    ]
    # No Prometheus namespace named: the internal port admits the autoscaler only, and the
    # autoscaler nothing at all.
    quiet = policies(render(helm))
    assert len(quiet["gateway"]["ingress"][1]["from"]) == 1
    assert quiet["autoscaler"]["ingress"] == []
    assert not by_kind(render(helm, {"networkPolicies": {"enabled": False}}), "NetworkPolicy")


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"rbac": {"clusterwide": True}}, "'clusterwide' not allowed"),
        (
            {"operator": {"allowedHostPathPrefixes": ["var/cache"]}},
            "/operator/allowedHostPathPrefixes",
        ),
        ({"operator": {"allowedImages": "vllm/vllm-openai"}}, "/operator/allowedImages"),
        ({"networkPolicies": {"enable": True}}, "'enable' not allowed"),
    ],
)
def test_a_typo_in_the_security_values_fails(
    helm: Path, values: dict[str, Any], complaint: str
) -> None:
    error = render_error(helm, values)
    assert "schema" in error and complaint in error, error
