"""Issue 23's cluster attacks, by a namespace team, against a real API server and the chart.

The attacker is a ServiceAccount with namespace-admin rights in its own namespace (`admin`,
plus LLMDeployments): what a team that may deploy models has. Each attack must fail:
- a route ConfigMap it writes itself (unsigned, or with a made-up signature, pointing at its
  own server) is not served, and the gateway logs why;
- its own LLMDeployment that squats the real team's LLMDeployment, tenant and model names
  (its namespace `aaa-evil` sorts first: before, its route won the model and took the
  tenant) changes nothing for the real team, whose key still reaches only its own replica;
- its spill-over to cloud metadata (169.254.169.254) is refused, with a log line;
- `..` paths are refused by `kubectl apply` itself (CEL rules of the CRD), a node folder
  outside the admin's prefixes and an image outside the admin's list by the operator
  (Degraded, a Warning Event naming the value and the setting, no engine Deployment);
- the engine pods it gets run non-root on read-only root filesystems without a token;
- with the chart's defaults, the chart's ServiceAccounts can do nothing outside their
  namespaces: `kubectl auth can-i` answers no for patching pods, reading Secrets or
  creating Deployments elsewhere (RBAC namespaced by default; cluster-wide only on request).

Control plane only (no kubelet): the gateway runs as a process with the chart's gateway
ServiceAccount, and EndpointSlices written here point it at in-test OpenAI stand-ins.

    uv run pytest e2e/test_attacks_cluster.py
"""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import CHART, RELEASE, SYSTEM_NAMESPACE
from k8s.kube_gateway import KubeGateway, endpoint_slice, host_address, stand_in
from k8s.kubectl import Kube, OperatorProcess, condition, wait_for

from servefleet.api.conventions import engine_selector

EVIL = "aaa-evil"  # sorts before the victim's namespace
VICTIM = "team-victim"
MODEL = "llama"
TENANT = "team-a"
NAME = "chat"  # the victim's LLMDeployment; the attacker names its own the same
EVIL_KEY = "sk-evil-own-key"
VICTIM_KEY = "sk-victim-key"


# ----------------------------------------------------------------------------- helpers


def team_kube(kube: Kube, namespace: str, path: Path) -> Kube:
    """A namespace team: `admin` in its namespace, and every verb on LLMDeployments there."""
    kube.kubectl("create", "namespace", namespace, check=False)
    kube.kubectl("create", "serviceaccount", "team", "-n", namespace, check=False)
    subject = f"--serviceaccount={namespace}:team"
    kube.kubectl(
        "create", "rolebinding", "team-admin", "--clusterrole=admin", subject, "-n", namespace,
        check=False,
    )  # fmt: skip
    kube.apply_text(
        yaml.safe_dump_all(
            [
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "Role",
                    "metadata": {"name": "llmdeployments", "namespace": namespace},
                    "rules": [
                        {
                            "apiGroups": ["servefleet.io"],
                            "resources": ["llmdeployments", "llmdeployments/status"],
                            "verbs": ["*"],
                        }
                    ],
                },
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "RoleBinding",
                    "metadata": {"name": "llmdeployments", "namespace": namespace},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "Role",
                        "name": "llmdeployments",
                    },
                    "subjects": [
                        {"kind": "ServiceAccount", "name": "team", "namespace": namespace}
                    ],
                },
            ]
        )
    )
    config = kube.service_account_kubeconfig(namespace, "team", path)
    return Kube(config, kube.kubectl_bin, kube.helm_bin)


def llmd(name: str, namespace: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"name": MODEL, "source": {"builtin": "smollm2-135m-instruct"}}}
        | (spec or {}),
    }


def secret(name: str, namespace: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def apply(kube: Kube, *docs: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return kube.kubectl_result("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))


@pytest.fixture(scope="module")
def evil(kube: Kube, installed_chart: Path, tmp_path_factory: pytest.TempPathFactory) -> Kube:
    return team_kube(kube, EVIL, tmp_path_factory.mktemp("evil") / "kubeconfig")


@pytest.fixture
def gateway(
    kube: Kube, installed_chart: Path, route_key_file: Path, tmp_path: Path
) -> Iterator[KubeGateway]:
    kubeconfig = kube.service_account_kubeconfig(
        SYSTEM_NAMESPACE, f"{RELEASE}-gateway", tmp_path / "gateway.kubeconfig"
    )
    process = KubeGateway(kubeconfig, route_key_file, tmp_path)
    try:
        yield process
    finally:
        process.stop()


# ----------------------------------------------------------------------------- routes


def forged_route(owner_uid: str, address: str, port: int) -> dict[str, Any]:
    """A route the team writes itself: the victim's model and tenant name, its own key, its
    own server as a static endpoint, an ownerReference to its own LLMDeployment."""
    fragment = {
        "tenants": [
            {
                "name": TENANT,
                "api_keys": [{"source": {"file": f"/etc/servefleet/secrets/{EVIL}/evil/api-key"}}],
            }
        ],
        "deployments": [
            {
                "name": "forged",
                "model": MODEL,
                "endpoints": [f"http://{address}:{port}"],
                "tenants": [{"name": TENANT}],
            }
        ],
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "forged-gateway-route",
            "namespace": EVIL,
            "labels": {"servefleet.io/gateway-route": "true"},
            "annotations": {"servefleet.io/route-signature": "v1:" + "0" * 64},
            "ownerReferences": [
                {
                    "apiVersion": "servefleet.io/v1alpha1",
                    "kind": "LLMDeployment",
                    "name": NAME,
                    "uid": owner_uid,
                    "controller": True,
                }
            ],
        },
        "data": {"gateway.yaml": yaml.safe_dump(fragment)},
    }


def test_forged_and_squatting_routes_change_nothing_for_the_real_team(
    kube: Kube, evil: Kube, operator: OperatorProcess, gateway: KubeGateway
) -> None:
    kube.kubectl("create", "namespace", VICTIM, check=False)
    victim = llmd(NAME, VICTIM, {"tenants": [tenant("victim-key")]})
    done = apply(kube, secret("victim-key", VICTIM, {"api-key": VICTIM_KEY}), victim)
    assert done.returncode == 0, done.stderr
    # The attacker: the same LLMDeployment, tenant and model names, its own key, and
    # spill-over to the cloud metadata address.
    spill = {
        "enabled": True,
        "baseURL": "http://169.254.169.254/latest",
        "model": "gpt",
        "apiKeySecretRef": {"name": "evil", "key": "api-key"},
    }
    squat = llmd(NAME, EVIL, {"tenants": [tenant("evil")], "spillover": spill})
    done = apply(evil, secret("evil", EVIL, {"api-key": EVIL_KEY}), squat)
    assert done.returncode == 0, done.stderr
    for namespace in (VICTIM, EVIL):
        wait_for(
            f"the operator's route in {namespace}",
            lambda n=namespace: kube.get("configmap", f"{NAME}-gateway-route", n),
            timeout=60,
        )
    owner = kube.get("llmd", NAME, EVIL)
    assert owner is not None
    address = host_address()
    with (
        stand_in(address) as (victim_replica, victim_port),
        stand_in(address) as (evil_replica, evil_port),
        stand_in(address) as (attacker_server, attacker_port),
    ):
        done = apply(evil, forged_route(owner["metadata"]["uid"], address, attacker_port))
        assert done.returncode == 0, done.stderr  # a team may write ConfigMaps: not served
        unsigned = forged_route(owner["metadata"]["uid"], address, attacker_port)
        unsigned["metadata"]["name"] = "unsigned-gateway-route"
        del unsigned["metadata"]["annotations"]
        assert apply(evil, unsigned).returncode == 0
        # Discovery of each team's own engine Service (written as the EndpointSlice
        # controller would).
        apply(kube, endpoint_slice(VICTIM, f"{NAME}-engine", address, victim_port))
        apply(kube, endpoint_slice(EVIL, f"{NAME}-engine", address, evil_port))

        wait_for(
            "the victim's key to work", lambda: gateway.status(VICTIM_KEY, MODEL) == 200, timeout=90
        )
        wait_for(
            "the attacker's key to work", lambda: gateway.status(EVIL_KEY, MODEL) == 200, timeout=60
        )
        before = len(victim_replica.stats.requests), len(evil_replica.stats.requests)
        for _ in range(3):
            assert gateway.status(VICTIM_KEY, MODEL) == 200
        assert len(victim_replica.stats.requests) == before[0] + 3
        assert len(evil_replica.stats.requests) == before[1]  # each key reaches its own
        assert gateway.status(EVIL_KEY, MODEL) == 200
        assert len(evil_replica.stats.requests) == before[1] + 1
        assert attacker_server.stats.requests == []  # the forged route was never served
    logs = gateway.logs()
    assert f"route {EVIL}/forged-gateway-route rejected" in logs and "bad signature" in logs
    assert f"route {EVIL}/unsigned-gateway-route rejected" in logs and "unsigned" in logs
    assert f"route {VICTIM}/{NAME}-gateway-route rejected" not in logs
    assert f"route {EVIL}/{NAME}-gateway-route rejected" not in logs
    assert "169.254.169.254" in logs and "spill-over off" in logs
    for key in (VICTIM_KEY, EVIL_KEY):
        assert key not in logs


def tenant(secret_name: str) -> dict[str, Any]:
    return {
        "name": TENANT,
        "apiKeySecretRef": {"name": secret_name, "key": "api-key"},
        "limits": {"requestsPerMinute": 600},
    }


# ----------------------------------------------------------------------------- the node


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"name": "m", "source": {"pvc": {"claimName": "c", "path": "../../../etc"}}},
            "model.source.pvc.path must be a path inside its volume",
        ),
        (
            {"name": "m", "source": {"oci": {"reference": "r/m:1", "path": "/etc"}}},
            "model.source.oci.path must be a path inside its volume",
        ),
        (
            {
                "name": "m",
                "source": {"url": "https://models.example/m.gguf"},
                "cache": {"hostPath": {"path": "/var/cache/servefleet/../../../etc"}},
            },
            "model.cache.hostPath.path must be an absolute folder without '..' segments",
        ),
        (
            {"name": "m", "source": {"s3": {"url": "s3://bucket/a/../../etc/"}}},
            "model.source.s3.url must not contain '..' segments",
        ),
    ],
)
def test_paths_that_climb_out_are_refused_by_kubectl_apply_itself(
    evil: Kube, model: dict[str, Any], message: str
) -> None:
    doc = llmd("climb", EVIL, {"model": model})
    done = apply(evil, doc)
    assert done.returncode != 0, "accepted"
    assert message in done.stderr, done.stderr
    assert evil.get("llmd", "climb", EVIL) is None


def refusal(kube: Kube, name: str) -> dict[str, Any]:
    def degraded() -> dict[str, Any] | None:
        found = condition(kube.get("llmd", name, EVIL), "Degraded")
        return found if found and found["status"] == "True" else None

    found: dict[str, Any] = wait_for(f"{name} refused", degraded, timeout=60)
    return found


def warning_events(kube: Kube, name: str) -> list[dict[str, Any]]:
    events = json.loads(
        kube.kubectl(
            "get", "events", "-n", EVIL, "-o", "json",
            "--field-selector", f"involvedObject.name={name},type=Warning",
        )
    )["items"]  # fmt: skip
    found: list[dict[str, Any]] = events
    return found


@pytest.mark.parametrize(
    ("name", "spec", "reason", "named"),
    [
        (
            "miner",
            {"engine": {"image": "evil.example/miner:1"}},
            "ImageNotAllowed",
            ["evil.example/miner:1", "operator.allowedImages"],
        ),
        (
            "node-root",
            {
                "model": {
                    "name": "m",
                    "source": {"url": "https://models.example/m.gguf"},
                    "cache": {"hostPath": {"path": "/etc"}},
                }
            },
            "HostPathNotAllowed",
            ["/etc", "operator.allowedHostPathPrefixes"],
        ),
    ],
)
def test_what_the_admin_does_not_allow_is_refused_with_a_condition_and_an_event(
    kube: Kube,
    evil: Kube,
    operator: OperatorProcess,
    name: str,
    spec: dict[str, Any],
    reason: str,
    named: list[str],
) -> None:
    done = apply(evil, llmd(name, EVIL, spec))
    assert done.returncode == 0, done.stderr  # only the operator knows the admin's lists
    degraded = refusal(kube, name)
    assert degraded["reason"] == reason
    assert all(text in degraded["message"] for text in named), degraded
    wait_for(
        f"a Warning Event {reason}",
        lambda: any(
            e["reason"] == reason and all(t in e["message"] for t in named)
            for e in warning_events(kube, name)
        ),
        timeout=30,
    )
    # Nothing of it runs: no engine Deployment, no route.
    assert kube.get("deployment", f"{name}-engine", EVIL) is None
    assert kube.get("configmap", f"{name}-gateway-route", EVIL) is None


RESTRICTED = "attack-restricted"


def test_engine_pods_pass_the_restricted_pod_security_standard(
    kube: Kube, operator: OperatorProcess
) -> None:
    """Non-root, read-only root filesystem, no privilege, no token, for every engine kind:
    the API server's own Pod Security admission (`restricted`, enforced on the namespace)
    lets the ReplicaSet create the pods."""
    kube.kubectl("create", "namespace", RESTRICTED, check=False)
    kube.kubectl(
        "label", "namespace", RESTRICTED, "pod-security.kubernetes.io/enforce=restricted",
        "--overwrite",
    )  # fmt: skip
    # The admission is on: a pod as vLLM's image would run it (root, writable) is refused.
    root = kube.kubectl_result(
        "run", "root", "--image=vllm/vllm-openai:v0.10.1.1", "-n", RESTRICTED
    )
    assert root.returncode != 0 and "violates PodSecurity" in root.stderr, root.stderr
    vllm = {
        "model": {"name": "m", "source": {"url": "https://models.example/m.gguf"}},
        "engine": {"kind": "vllm"},
    }
    done = apply(kube, llmd("plain", RESTRICTED), llmd("vllm", RESTRICTED, vllm))
    assert done.returncode == 0, done.stderr
    for name in ("plain", "vllm"):
        deployment = wait_for(
            f"the {name} engine Deployment",
            lambda n=name: kube.get("deployment", f"{n}-engine", RESTRICTED),
            timeout=60,
        )
        pod = deployment["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        for container in [*pod["containers"], *pod.get("initContainers", [])]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
        wait_for(
            f"a {name} engine pod admitted by Pod Security",
            lambda n=name: kube.list("pods", RESTRICTED, f"servefleet.io/llmdeployment={n}"),
            timeout=60,
        )
    policy = kube.get("networkpolicy", "plain-engine", RESTRICTED)
    assert policy is not None
    peers = policy["spec"]["ingress"][0]["from"]
    # A pod of the team's own namespace labelled like the gateway matches no peer; the last
    # peer is the deployment's own engines (its namespace only), which pull KV from each other.
    chart_namespace = {"matchLabels": {"kubernetes.io/metadata.name": SYSTEM_NAMESPACE}}
    selectors = [p.get("namespaceSelector") for p in peers]
    assert selectors == [chart_namespace, chart_namespace, None]
    assert peers[2] == {"podSelector": {"matchLabels": engine_selector("plain")}}


# ----------------------------------------------------------------------------- RBAC

CONFINED = "sf-confined"
CONFINED_RELEASE = "confined"


@pytest.fixture(scope="module")
def confined_release(kube: Kube, installed_chart: Path) -> Iterator[str]:
    """The chart installed with its defaults (RBAC namespaced), a second time, in its own
    namespace: what `helm install` gives an admin who changes nothing."""
    kube.kubectl("create", "namespace", CONFINED, check=False)
    kube.helm(
        "upgrade", "--install", CONFINED_RELEASE, str(CHART), "--namespace", CONFINED,
        "--skip-crds",
    )  # fmt: skip
    try:
        yield CONFINED
    finally:
        kube.helm("uninstall", CONFINED_RELEASE, "--namespace", CONFINED)


def can_i(kube: Kube, account: str, namespace: str, *what: str) -> bool:
    done = kube.kubectl_result(
        "auth", "can-i", *what, "-n", namespace, f"--as=system:serviceaccount:{account}"
    )
    return done.stdout.strip() == "yes"


def test_the_charts_service_accounts_cannot_act_outside_their_namespace(
    kube: Kube, confined_release: str
) -> None:
    prefix = f"{CONFINED}:{CONFINED_RELEASE}-servefleet"
    operator, gateway, autoscaler = (f"{prefix}-{c}" for c in ("operator", "gateway", "autoscaler"))
    for elsewhere in ("kube-system", VICTIM, "default"):
        assert not can_i(kube, autoscaler, elsewhere, "patch", "pods")
        assert not can_i(kube, gateway, elsewhere, "get", "secrets")
        assert not can_i(kube, gateway, elsewhere, "list", "configmaps")
        assert not can_i(kube, operator, elsewhere, "create", "deployments.apps")
        assert not can_i(kube, operator, elsewhere, "create", "secrets")
    # In their own namespace they have what they need, and the autoscaler still no pod writes.
    assert can_i(kube, operator, CONFINED, "create", "deployments.apps")
    assert can_i(kube, gateway, CONFINED, "get", "secrets")
    assert can_i(kube, autoscaler, CONFINED, "list", "pods")
    assert not can_i(kube, autoscaler, CONFINED, "patch", "pods")
    assert not can_i(kube, gateway, CONFINED, "list", "secrets")
    # Even the cluster-wide opt-in (the other release) gives the autoscaler no pod writes.
    wide = f"{SYSTEM_NAMESPACE}:{RELEASE}-autoscaler"
    assert can_i(kube, wide, VICTIM, "list", "pods")
    assert not can_i(kube, wide, VICTIM, "patch", "pods")


def test_generated_keys_survive_an_upgrade(kube: Kube, confined_release: str) -> None:
    def keys() -> dict[str, Any]:
        found = {}
        for name in ("internal", "route-signing"):
            generated = kube.get("secret", f"{CONFINED_RELEASE}-servefleet-{name}", CONFINED)
            assert generated is not None
            found[name] = generated["data"]
        return found

    before = keys()
    kube.helm(
        "upgrade", CONFINED_RELEASE, str(CHART), "--namespace", CONFINED, "--skip-crds",
        "--set", "operator.resyncSeconds=10",
    )  # fmt: skip
    assert keys() == before
