"""NetworkPolicies on a node that enforces them: the chart's fences hold against pods that lie.

The e2e node enforces policies with kube-router's firewall (`e2e/k8s/firewall.py`); the
first test proves it does, with a plain policy (a pod denied, then allowed by a label), so
the rest cannot pass on a network that lets everything through. Then the attacks of issue 23
from pods a namespace team may create: in another namespace, and in the engines' own
namespace, plain or labelled like the chart's gateway, its autoscaler or a Prometheus (all
with the engine-client label the engine policy once trusted), all at once for `WINDOW_S`, try to
open connections to the engine port, the gateway's internal port and Redis. Every attempt
must fail, while the same pods still reach the gateway's tenant port, the chart's own pods
reach what they need (gateway to engines and Redis, autoscaler to the gateway's internal
port), and another tenant's requests through the gateway keep their p99 within `P99_FACTOR`
of the slower of the quiet runs measured just before and after. Last, with the deployment at
two replicas, each engine reaches the other's KV routes (`/internal/kv/info`, with the engine
key its pod holds), while pods labelled as another deployment's engine, or as this one's in
another namespace, cannot connect to either.

The module installs the chart itself (Redis on) and removes it, its namespaces and its
LLMDeployment at the end, so it runs alone or beside the other node tests. Run (as root):
`uv run pytest e2e/test_node_network_policy.py -q -s` (`-s` prints the attack table).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from k8s.kubectl import Kube, is_ready, wait_for
from k8s.netprobe import Tally, Target, probe, probe_pod, start_pod
from k8s.node import NodeCluster

from servefleet.api.conventions import (
    ENGINE_CONTAINER,
    ENGINE_KEY_SECRET_KEY,
    LABEL_APP_COMPONENT,
    LABEL_DEPLOYMENT,
    engine_key_secret_name,
)
from servefleet.api.engine_flags import API_KEY_ENV
from servefleet.api.engines import engine_adapter
from servefleet.api.kv_transfer import INFO_PATH
from servefleet.bench.attack_common import (
    P99_FACTOR,
    AttackResult,
    VictimFigures,
    VictimWindow,
    judge_victim,
)
from servefleet.bench.fault_stack import MODEL, api_key

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "servefleet"
EXAMPLE = ROOT / "examples" / "llmdeployment.yaml"
RELEASE = "servefleet"
SYSTEM_NAMESPACE = "servefleet"
TEAM = "np-team"  # the engines' namespace, and a team's pods in it
OTHER = "np-other"  # another team's namespace
PROOF = "np-proof"  # the plain-policy proof
LLMD = "np-model"
VICTIM = "victim"
# The label the engine policy once admitted from any namespace: every impostor adds it.
ENGINE_CLIENT = {"servefleet.io/engine-client": "true"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus", "app": "prometheus"} | ENGINE_CLIENT
ENGINE_PORT = engine_adapter("servefleet").port
REDIS_PORT = 6379
WINDOW_S = 20.0  # each attack's length, and the quiet run's
WARMUP_S = 10.0  # the victim's load before the first quiet run, not measured
STARTUP_TIMEOUT_S = 480
ENFORCED_S = 60  # a policy change reaches iptables on the next kube-router sync

pytestmark = pytest.mark.timeout(1500)


def split_image(ref: str) -> tuple[str, str]:
    repository, _, tag = ref.rpartition(":")
    return repository, tag


def team_manifests() -> str:
    """The README's example in TEAM: one engine, the victim tenant with roomy limits."""
    secret, llmd = yaml.safe_load_all(EXAMPLE.read_text())
    secret["metadata"]["name"] = "victim-key"
    secret["stringData"] = {"api-key": api_key(VICTIM)}
    llmd["metadata"]["name"] = LLMD
    llmd["spec"]["engine"]["resources"]["requests"] = {"cpu": "250m", "memory": "1Gi"}
    llmd["spec"]["pool"] = {"minReplicas": 1, "maxReplicas": 1}
    llmd["spec"]["tenants"] = [
        {
            "name": VICTIM,
            "apiKeySecretRef": {"name": "victim-key", "key": "api-key"},
            "limits": {"requestsPerMinute": 100000, "tokensPerMinute": 10000000},
        }
    ]
    return yaml.safe_dump_all([secret, llmd])


@dataclass
class Stack:
    """The chart, the team's engine and the pods and addresses the tests aim at."""

    kube: Kube
    images: dict[str, str]
    pull_policy: str

    def chart_pod(self, component: str) -> dict[str, Any]:
        pods = self.kube.list("pods", SYSTEM_NAMESPACE, f"{LABEL_APP_COMPONENT}={component}")
        ready = [p for p in pods if is_ready(p) and not p["metadata"].get("deletionTimestamp")]
        assert ready, f"no ready {component} pod"
        return ready[0]

    def ready_engine_pod(self) -> dict[str, Any] | None:
        llmd = self.kube.get("llmd", LLMD, TEAM) or {}
        selector = llmd.get("status", {}).get("selector")
        pods = self.kube.list("pods", TEAM, selector) if selector else []
        return next((p for p in pods if is_ready(p)), None)

    def wait_engine(self) -> None:
        wait_for("the team's engine", self.ready_engine_pod, STARTUP_TIMEOUT_S, interval=2)

    def engine_pod(self) -> dict[str, Any]:
        pod = self.ready_engine_pod()
        assert pod is not None, "no ready engine pod"
        return pod

    def service(self, component: str) -> dict[str, Any]:
        service = self.kube.get("service", f"{RELEASE}-{component}", SYSTEM_NAMESPACE)
        assert service is not None, f"no {component} Service"
        return service

    def port(self, component: str, name: str) -> Target:
        service = self.service(component)
        port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == name)
        return service["spec"]["clusterIP"], port

    def gateway_url(self) -> str:
        host, port = self.port("gateway", "http")
        return f"http://{host}:{port}"

    def forbidden(self) -> dict[str, Target]:
        """What no tenant-side pod may connect to, by pod address and by Service address."""
        gateway = self.chart_pod("gateway")
        internal = self.port("gateway", "internal")
        return {
            "engine": (self.engine_pod()["status"]["podIP"], ENGINE_PORT),
            "gateway internal (pod)": (gateway["status"]["podIP"], internal[1]),
            "gateway internal (Service)": internal,
            "redis (pod)": (self.chart_pod("redis")["status"]["podIP"], REDIS_PORT),
            "redis (Service)": self.port("redis", "redis"),
        }

    def start_probe(self, name: str, namespace: str, labels: dict[str, str]) -> str:
        image = self.images["control-plane"]
        start_pod(self.kube, probe_pod(name, namespace, labels, image, self.pull_policy))
        return name


@pytest.fixture(scope="module")
def stack(node_cluster: NodeCluster) -> Iterator[Stack]:
    kube = node_cluster.kube
    repo, tag = split_image(node_cluster.images["control-plane"])
    engine_repo, engine_tag = split_image(node_cluster.images["engine"])
    redis = (
        ["--set", f"redis.image={node_cluster.images['redis']}"]
        if "redis" in node_cluster.images
        else []
    )
    for namespace in (TEAM, OTHER, PROOF):  # TEAM before the chart: its Roles bind there
        kube.kubectl("create", "namespace", namespace, check=False)
    kube.helm(
        "upgrade", "--install", RELEASE, str(CHART), "--namespace", SYSTEM_NAMESPACE,
        "--create-namespace", "--wait", "--timeout=5m",
        "--set", f"operator.watchNamespaces={{{TEAM}}}",
        "--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
        "--set", f"image.pullPolicy={node_cluster.pull_policy}",
        "--set", f"engineImage.repository={engine_repo}", "--set", f"engineImage.tag={engine_tag}",
        "--set", "operator.resyncSeconds=5", "--set", "redis.enabled=true", *redis,
    )  # fmt: skip
    kube.apply_text(team_manifests(), TEAM)
    try:
        yield Stack(kube, node_cluster.images, node_cluster.pull_policy)
    finally:
        kube.kubectl(
            "delete", "llmd", LLMD, "-n", TEAM, "--wait=true", "--timeout=120s", check=False
        )
        for namespace in (TEAM, OTHER, PROOF):
            kube.kubectl("delete", "namespace", namespace, "--timeout=120s", check=False)
        kube.helm("uninstall", RELEASE, "--namespace", SYSTEM_NAMESPACE, "--wait")


def policy(name: str, selector: dict[str, str], ingress: list[dict[str, Any]]) -> str:
    spec = {
        "podSelector": {"matchLabels": selector},
        "policyTypes": ["Ingress"],
        "ingress": ingress,
    }
    body = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy"}
    return json.dumps({**body, "metadata": {"name": name}, "spec": spec})


def test_the_node_enforces_a_plain_policy(stack: Stack) -> None:
    """Both clients reach the server with no policy; a deny-all blocks both; a policy that
    admits `role=friend` lets the friend through and not the stranger, until the stranger
    labels itself a friend."""
    kube = stack.kube
    server = probe_pod(
        "server", PROOF, {"app": "server"}, stack.images["control-plane"], stack.pull_policy
    )
    server["spec"]["containers"][0]["command"] = ["python3", "-m", "http.server", "8080"]
    server_ip = start_pod(kube, server)["status"]["podIP"]
    stranger = stack.start_probe("stranger", PROOF, {"role": "stranger"})
    friend = stack.start_probe("friend", PROOF, {"role": "friend"})
    target = {"server": (server_ip, 8080)}

    def outcome(client: str) -> Tally:
        return probe(kube, PROOF, client, target)["server"]

    def reaches(client: str) -> Callable[[], bool]:
        return lambda: outcome(client).reached

    def blocked(client: str) -> Callable[[], bool]:
        return lambda: outcome(client).blocked

    for client in (stranger, friend):
        wait_for(f"{client} to reach the server", reaches(client), 60, 1)
    start = time.monotonic()
    kube.apply_text(policy("deny-all", {"app": "server"}, []), PROOF)
    for client in (stranger, friend):
        wait_for(f"deny-all to block {client}", blocked(client), ENFORCED_S, 1)
    print(f"\ndeny-all enforced {time.monotonic() - start:.1f}s after it was applied")
    allow = [{"from": [{"podSelector": {"matchLabels": {"role": "friend"}}}]}]
    kube.apply_text(policy("allow-friends", {"app": "server"}, allow), PROOF)
    wait_for("allow-friends to admit the friend", reaches(friend), ENFORCED_S, 1)
    assert outcome(stranger).blocked, "a pod without the admitted label got through"
    kube.kubectl("label", "pod", stranger, "-n", PROOF, "role=friend", "--overwrite")
    wait_for("the relabelled stranger to get through", reaches(stranger), 60, 1)


def victim_answers(url: str) -> bool:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {api_key(VICTIM)}"}
    try:
        return (
            httpx.post(
                url + "/v1/chat/completions", json=body, headers=headers, timeout=60
            ).status_code
            == 200
        )
    except httpx.HTTPError:
        return False


def test_the_chart_renders_policies_for_engines_gateway_and_redis(stack: Stack) -> None:
    stack.wait_engine()
    pods = {
        "engine": stack.engine_pod(),
        "gateway": stack.chart_pod("gateway"),
        "redis": stack.chart_pod("redis"),
    }
    selected: dict[str, list[str]] = {}
    for what, pod in pods.items():
        namespace, labels = pod["metadata"]["namespace"], pod["metadata"].get("labels", {})
        for item in stack.kube.list("networkpolicies", namespace):
            selector = item["spec"].get("podSelector", {})
            wanted = selector.get("matchLabels", {})
            if not selector.get("matchExpressions") and wanted.items() <= labels.items():
                selected.setdefault(what, []).append(item["metadata"]["name"])
    missing = sorted(pods.keys() - selected.keys())
    assert not missing, f"no NetworkPolicy selects the {missing} pods (found {selected})"


def test_the_chart_pods_reach_what_they_need(stack: Stack) -> None:
    """The allowed paths work: the fences are not just 'everything blocked'."""
    stack.wait_engine()
    gateway = stack.chart_pod("gateway")["metadata"]["name"]
    autoscaler = stack.chart_pod("autoscaler")["metadata"]["name"]
    forbidden = stack.forbidden()
    from_gateway = probe(
        stack.kube, SYSTEM_NAMESPACE, gateway,
        {"engine": forbidden["engine"], "redis": forbidden["redis (Service)"]},
    )  # fmt: skip
    from_autoscaler = probe(
        stack.kube, SYSTEM_NAMESPACE, autoscaler,
        {"gateway internal": forbidden["gateway internal (Service)"]},
    )  # fmt: skip
    outcomes = {f"gateway -> {k}": v for k, v in from_gateway.items()}
    outcomes |= {f"autoscaler -> {k}": v for k, v in from_autoscaler.items()}
    assert all(t.reached for t in outcomes.values()), {k: str(v) for k, v in outcomes.items()}
    assert wait_for(
        "the victim's first answer", lambda: victim_answers(stack.gateway_url()), 120, 2
    )


def attackers(stack: Stack) -> dict[str, tuple[str, dict[str, str]]]:
    """Pods a team may create, by what they pretend: (namespace, labels)."""

    def looks_like(component: str) -> dict[str, str]:
        labels = dict(stack.chart_pod(component)["metadata"]["labels"])
        return labels | ENGINE_CLIENT

    return {
        "pod in another namespace": (OTHER, {"app": "curious"}),
        "pod in the engines' namespace labelled as the gateway": (TEAM, looks_like("gateway")),
        "pod in another namespace labelled as the gateway": (OTHER, looks_like("gateway")),
        "pod in the engines' namespace labelled as the autoscaler": (
            TEAM,
            looks_like("autoscaler"),
        ),
        "pod in the engines' namespace labelled as Prometheus": (TEAM, PROMETHEUS),
    }


def test_no_tenant_side_pod_reaches_engines_gateway_internals_or_redis(stack: Stack) -> None:
    stack.wait_engine()
    url = stack.gateway_url()
    wait_for("the victim's first answer", lambda: victim_answers(url), 120, 2)
    pods = {
        name: stack.start_probe(f"attacker-{i}", namespace, labels)
        for i, (name, (namespace, labels)) in enumerate(attackers(stack).items())
    }
    namespaces = {name: ns for name, (ns, _) in attackers(stack).items()}
    forbidden = stack.forbidden()
    targets = forbidden | {"gateway tenant port": stack.port("gateway", "http")}
    with VictimWindow(url, VICTIM, WARMUP_S):
        pass  # first requests after the engine starts are slow: not part of the baseline

    def attack() -> list[AttackResult]:
        """Every attacker at once, in one window (five attackers together load the victim's
        node at least as much as any one of them), against the slower of the quiet runs just
        before and just after it: the two cores are shared with other tests (`make test` runs
        these beside the e2e suite), whose load drifts over a minute more than a window moves."""
        with VictimWindow(url, VICTIM, WINDOW_S) as before:
            pass
        with VictimWindow(url, VICTIM, WINDOW_S) as window, ThreadPoolExecutor(len(pods)) as pool:
            running = {
                name: pool.submit(probe, stack.kube, namespaces[name], pod, targets, WINDOW_S)
                for name, pod in pods.items()
            }
            tallies = {name: future.result() for name, future in running.items()}
        with VictimWindow(url, VICTIM, WINDOW_S) as after:
            pass
        quiet = max((before.figures, after.figures), key=lambda f: f.p99_ms or 0.0)
        results = []
        for name, pod in pods.items():
            result = AttackResult(name=pod, attack=name)
            judge(result, tallies[name], forbidden, quiet, window.figures)
            results.append(result)
        return results

    results = attack()
    if any(r.violations for r in results) and all(
        v.startswith("victim p99") for r in results for v in r.violations
    ):
        # Every connection was blocked; only the victim's p99 moved. A p99 of a few dozen
        # requests on two shared cores swings 3x between quiet windows (seen: 367 to
        # 1117 ms), so a slowdown counts when the attack shows it twice in a row.
        print(f"{results[0].violations[0]}; measuring again")
        first = {r.attack: r.victim for r in results}
        results = attack()
        for result in results:
            result.figures["first_measurement"] = first[result.attack]
    print(f"each attacker tried: {', '.join(forbidden)}")
    print(table(results))
    violations = {r.attack: r.violations for r in results if r.violations}
    assert not violations, violations


def judge(
    result: AttackResult,
    tallies: dict[str, Tally],
    forbidden: dict[str, Target],
    quiet: VictimFigures,
    attacked: VictimFigures,
) -> None:
    for target in forbidden:
        result.require(tallies[target].blocked, f"{target}: {tallies[target]}")
    control = tallies["gateway tenant port"]
    result.require(control.reached, f"the gateway's tenant port was not reachable: {control}")
    attempts = sum(tallies[t].attempts for t in forbidden)
    if all(tallies[t].blocked for t in forbidden):
        result.outcome = f"all {attempts} connections blocked; tenant port {control}"
    else:
        result.outcome = "; ".join(f"{t}: {tallies[t]}" for t in forbidden)
    result.figures["tallies"] = {t: str(v) for t, v in tallies.items()}
    judge_victim(result, quiet, attacked)


def table(results: list[AttackResult]) -> str:
    rows = [
        f"| attack | result | victim p99 quiet → under attack (≤ {P99_FACTOR}x) | verdict |",
        "|---|---|---|---|",
    ]
    for r in results:
        v = r.victim
        p99 = f"{v.get('quiet_p99_ms')} → {v.get('attack_p99_ms')} ms ({v.get('p99_ratio')}x)"
        verdict = "held" if not r.violations else "FAILED: " + "; ".join(r.violations)
        rows.append(f"| {r.attack} | {r.outcome} | {p99} | {verdict} |")
    return "\n".join(rows)


# ------------------------------------------------------------------ engine to engine (KV pulls)

KV_INFO_SCRIPT = r"""
import json, os, sys, urllib.error, urllib.request
url, env, key = sys.argv[1:4]
key = os.environ[env] if env else key
headers = {"Authorization": f"Bearer {key}"} if key else {}
try:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=3) as r:
        print(json.dumps({"status": r.status, "body": json.loads(r.read())}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": None}))
except Exception as e:
    print(json.dumps({"status": None, "error": type(e).__name__ + ": " + str(e)}))
"""


def kv_info(
    kube: Kube, namespace: str, pod: str, container: str, peer_ip: str, key: str | None = None
) -> dict[str, Any]:
    """GET a peer engine's `/internal/kv/info` from inside `pod`, as an engine pulling KV does:
    with the key in the container's own `API_KEY_ENV` (engines have it) when `key` is None,
    else with `key` ("" sends none)."""
    url = f"http://{peer_ip}:{ENGINE_PORT}{INFO_PATH}"
    env = API_KEY_ENV if key is None else ""
    out = kube.kubectl(
        "exec", "-n", namespace, pod, "-c", container, "--",
        "python3", "-c", KV_INFO_SCRIPT, url, env, key or "",
    )  # fmt: skip
    answer: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return answer


def set_engine_replicas(kube: Kube, replicas: int) -> None:
    patch = {"spec": {"pool": {"minReplicas": replicas, "maxReplicas": replicas}}}
    kube.kubectl("patch", "llmd", LLMD, "-n", TEAM, "--type", "merge", "-p", json.dumps(patch))


def ready_engine_pods(stack: Stack) -> list[dict[str, Any]]:
    llmd = stack.kube.get("llmd", LLMD, TEAM) or {}
    selector = llmd.get("status", {}).get("selector")
    pods = stack.kube.list("pods", TEAM, selector) if selector else []
    return [p for p in pods if is_ready(p) and not p["metadata"].get("deletionTimestamp")]


def engine_key(kube: Kube) -> str:
    encoded = kube.kubectl(
        "get", "secret", engine_key_secret_name(LLMD), "-n", TEAM,
        "-o", f"jsonpath={{.data.{ENGINE_KEY_SECRET_KEY}}}",
    )  # fmt: skip
    return base64.b64decode(encoded).decode()


def engines_reach_each_other(kube: Kube, names: list[str], ips: list[str]) -> None:
    """Each engine gets the other's KV info with its own key; both caches have one layout;
    the peer still refuses a request without the key."""

    def peer_info(i: int) -> dict[str, Any] | None:
        answer = kv_info(kube, TEAM, names[i], ENGINE_CONTAINER, ips[1 - i])
        return answer if answer["status"] == 200 else None

    # A new pod's address joins the policy's peer set on kube-router's next sync.
    infos = [
        wait_for(f"{names[i]} to reach {names[1 - i]}", lambda i=i: peer_info(i), ENFORCED_S, 2)
        for i in range(2)
    ]
    print(f"\nengine -> engine {INFO_PATH}: 200 both ways ({', '.join(names)})")
    assert infos[0]["body"]["fingerprint"] == infos[1]["body"]["fingerprint"], infos
    assert infos[0]["body"]["bytes_per_block"] > 0
    keyless = kv_info(kube, TEAM, names[0], ENGINE_CONTAINER, ips[1], key="")
    assert keyless["status"] == 401, f"a request without the engine key got {keyless}"


def impostor_failures(stack: Stack, pods: list[dict[str, Any]]) -> dict[str, Any]:
    """Pods labelled as another deployment's engine (same namespace) or as this deployment's
    (another namespace) try TCP and then the KV info route with the real engine key."""
    kube = stack.kube
    own = {k: v for k, v in pods[0]["metadata"]["labels"].items() if k != "pod-template-hash"}
    impostors = {
        "pod in the engines' namespace labelled as another deployment's engine": (
            TEAM,
            own | {LABEL_DEPLOYMENT: f"{LLMD}-other"},
        ),
        "pod in another namespace labelled as this deployment's engine": (OTHER, own),
    }
    key = engine_key(kube)
    ips = [p["status"]["podIP"] for p in pods]
    targets = {f"engine {p['metadata']['name']}": (p["status"]["podIP"], ENGINE_PORT) for p in pods}
    failures: dict[str, Any] = {}
    for i, (what, (namespace, labels)) in enumerate(impostors.items()):
        pod = stack.start_probe(f"kv-impostor-{i}", namespace, labels)
        tallies = probe(kube, namespace, pod, targets, seconds=WINDOW_S / 4)
        answers = [kv_info(kube, namespace, pod, "probe", ip, key=key) for ip in ips]
        print(f"{what}: " + ", ".join(f"{t}: {v}" for t, v in tallies.items()))
        got_through = [a for a in answers if a["status"] is not None]
        if not all(t.blocked for t in tallies.values()) or got_through:
            failures[what] = {"tallies": {t: str(v) for t, v in tallies.items()}, "http": answers}
    return failures


def test_engines_of_one_deployment_reach_each_others_kv_routes_and_nobody_else(
    stack: Stack,
) -> None:
    """KV pulls go engine to engine: with two replicas, each engine pod gets the other's
    `/internal/kv/info` (with the key from its own env; without a key: 401) and both report
    the same cache fingerprint. A pod labelled as another deployment's engine in the same
    namespace, and a pod labelled exactly as this deployment's engines in another namespace,
    cannot even connect to either engine, holding the engine key or not."""
    stack.wait_engine()
    set_engine_replicas(stack.kube, 2)
    try:

        def two_ready() -> list[dict[str, Any]] | None:
            pods = ready_engine_pods(stack)
            return pods if len(pods) == 2 else None

        pods = wait_for("two ready engine pods", two_ready, STARTUP_TIMEOUT_S, 2)
        names = [p["metadata"]["name"] for p in pods]
        engines_reach_each_other(stack.kube, names, [p["status"]["podIP"] for p in pods])
        failures = impostor_failures(stack, pods)
        assert not failures, failures
    finally:
        set_engine_replicas(stack.kube, 1)
