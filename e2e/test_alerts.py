"""Every alert of the chart fires on a real Prometheus when its condition is driven, and only then.

The rules are taken from `helm template` of the chart's PrometheusRule, with every `for:`
shortened through `metrics.prometheusRule.for` (which proves the override), checked with
`promtool check rules`, and loaded into `prometheus` (Debian package). The series come from
exporters this test runs with the components' own metric classes (`GatewayMetrics`,
`AutoscalerMetrics`, `EngineMetrics`; an SGLang gauge and kube-state-metrics' restart counter
under the names those projects export), scraped with the target labels a ServiceMonitor
scrape adds (namespace, service, pod). Each alert has a sick subject (a deployment, model,
pod or gateway) driven into its condition and a healthy twin beside it: every alert must
fire for the sick one, and nothing may fire for a healthy one.

    uv run pytest e2e/test_alerts.py -s
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from procs import free_port
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from servefleet.api.gateway_stats import DeploymentStats
from servefleet.api.outcomes import Outcome
from servefleet.autoscaler.explain import Reason
from servefleet.autoscaler.policy import Decision, PolicyState
from servefleet.autoscaler.telemetry import AutoscalerMetrics
from servefleet.engine.metrics import EngineMetrics
from servefleet.gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "servefleet"
ALERT_FILES = sorted((CHART / "files" / "alerts").glob("*.yaml"))
TICK_S = 0.5
FIRING_TIMEOUT_S = 120

# (alert, the label that names its subject) → the sick subjects it must fire for.
EXPECTED: dict[tuple[str, str], set[str]] = {
    ("ServefleetErrorBudgetBurnFast", "model"): {"sick-model"},
    ("ServefleetErrorBudgetBurnSlow", "model"): {"sick-model"},
    ("ServefleetPoolAtMaxReplicasWithQueue", "deployment"): {"sick"},
    ("ServefleetSpillOverHigh", "model"): {"sick-model"},
    ("ServefleetKVCacheSaturated", "pod"): {"sick-engine-0", "sglang-engine-0"},
    ("ServefleetNoReadyReplica", "deployment"): {"sick"},
    ("ServefleetEngineRestarting", "pod"): {"sick-engine-0"},
    ("ServefleetRedisDown", "pod"): {"servefleet-gateway-0"},
    ("ServefleetTenantBudgetHigh", "tenant"): {"acme"},
    ("ServefleetAutoscalerNotActing", "deployment"): {"sick"},
}


@dataclass
class Target:
    job: str
    registry: CollectorRegistry
    labels: dict[str, str]


def decision(desired: int, current: int) -> Decision:
    return Decision(desired=desired, current=current, reason=Reason.DEMAND, state=PolicyState())


class Fleet:
    """The series of one sick and one healthy subject per alert, advanced every tick."""

    def __init__(self) -> None:
        self.gateways = [GatewayMetrics(), GatewayMetrics()]  # 0: sick (no Redis), 1: healthy
        self.autoscaler = AutoscalerMetrics()
        self.engines = {"sick": EngineMetrics("sick-model"), "ok": EngineMetrics("ok-model")}
        self.sglang = CollectorRegistry()
        Gauge("sglang:token_usage", "KV use", ["model_name"], registry=self.sglang).labels(
            "sglang-model"
        ).set(0.98)
        self.kube_state = CollectorRegistry()
        self.restarts = Counter(
            "kube_pod_container_status_restarts",
            "Container restarts (kube-state-metrics' series).",
            ["namespace", "pod", "container"],
            registry=self.kube_state,
        )
        self._setup()

    def _setup(self) -> None:
        sick, healthy = self.gateways
        sick.limits_degraded.set(1)
        healthy.limits_degraded.set(0)
        # 85 % of acme's daily cost budget used (another replica saw less); beta at 79 %.
        sick.budget_used_ratio.labels("acme", "daily", "cost").set(0.85)
        healthy.budget_used_ratio.labels("acme", "daily", "cost").set(0.6)
        healthy.budget_used_ratio.labels("beta", "monthly", "tokens").set(0.79)
        sick.set_pool_gauges(
            DeploymentStats(name="sick", model="sick-model", queue_depth_interactive=5)
        )
        healthy.set_pool_gauges(DeploymentStats(name="ok", model="ok-model", ready_replicas=2))
        self.engines["sick"].kv_cache_usage.set(0.99)
        self.engines["ok"].kv_cache_usage.set(0.40)
        # At maxReplicas (4) and no longer deciding anything: one decision, then silence.
        self.autoscaler.record("sick", decision(4, 4))
        self.autoscaler.max_replicas.labels("sick").set(4)
        self.autoscaler.max_replicas.labels("ok").set(4)
        self.restarts.labels("team-a", "ok-engine-0", "engine")  # exists, never restarts

    def tick(self) -> None:
        sick = self.gateways[0].for_tenant("acme", "sick-model")
        sick.outcome[Outcome.OK].inc(1)
        sick.outcome[Outcome.UPSTREAM_ERROR].inc(5)
        sick.outcome[Outcome.SHED].inc(5)
        self.gateways[0].spillovers.labels("sick-model", "no ready replica").inc(3)
        healthy = self.gateways[1].for_tenant("acme", "ok-model")
        healthy.outcome[Outcome.OK].inc(10)
        healthy.outcome[Outcome.REJECTED].inc(2)  # the tenant's own errors spend no budget
        self.autoscaler.record("ok", decision(2, 2))
        self.restarts.labels("team-a", "sick-engine-0", "engine").inc()
        # A restarting sidecar is not an engine restart.
        self.restarts.labels("team-a", "ok-engine-0", "sidecar").inc()

    def targets(self) -> list[Target]:
        ns, engine_ns = {"namespace": "servefleet"}, {"namespace": "team-a"}
        return [
            Target("gateway", self.gateways[0].registry, {**ns, "pod": "servefleet-gateway-0"}),
            Target("gateway", self.gateways[1].registry, {**ns, "pod": "servefleet-gateway-1"}),
            Target(
                "autoscaler", self.autoscaler.registry, {**ns, "pod": "servefleet-autoscaler-0"}
            ),
            Target(
                "engine",
                self.engines["sick"].registry,
                {**engine_ns, "service": "sick-engine", "pod": "sick-engine-0"},
            ),
            Target(
                "engine",
                self.engines["ok"].registry,
                {**engine_ns, "service": "ok-engine", "pod": "ok-engine-0"},
            ),
            Target(
                "engine",
                self.sglang,
                {**engine_ns, "service": "sglang-engine", "pod": "sglang-engine-0"},
            ),
            Target("kube-state-metrics", self.kube_state, {}),
        ]


@pytest.fixture(scope="module")
def binaries() -> dict[str, str]:
    found = {name: shutil.which(name) for name in ("prometheus", "promtool")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        pytest.fail(f"{missing} not installed (Debian: apt-get install -y prometheus)")
    return {name: str(path) for name, path in found.items()}


def rendered_rules(helm: Path, overrides: dict[str, str]) -> dict[str, Any]:
    """The chart's PrometheusRule `spec` as a Prometheus rules file."""
    sets = [f"--set=metrics.prometheusRule.for.{name}={value}" for name, value in overrides.items()]
    argv = [str(helm), "template", "servefleet", str(CHART), "--namespace", "servefleet"]
    text = subprocess.run(
        [
            *argv,
            "--set=metrics.prometheusRule.enabled=true",
            *sets,
            "--show-only",
            "templates/prometheusrule.yaml",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (rule,) = [d for d in yaml.safe_load_all(text) if d]
    assert rule["kind"] == "PrometheusRule"
    return {"groups": rule["spec"]["groups"]}


def alert_fors(rules: dict[str, Any]) -> dict[str, str]:
    return {r["alert"]: r["for"] for g in rules["groups"] for r in g["rules"] if "alert" in r}


def promtool_check(promtool: str, path: Path) -> None:
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def serve_registry(registry: CollectorRegistry) -> ThreadingHTTPServer:
    """The registry in the text format our components serve (`generate_latest`, names with
    colons kept), whatever format the scraper asks for."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def exporters() -> Iterator[tuple[Fleet, list[tuple[Target, str]]]]:
    fleet = Fleet()
    servers = []
    served = []
    for target in fleet.targets():
        server = serve_registry(target.registry)
        servers.append(server)
        served.append((target, f"127.0.0.1:{server.server_address[1]}"))
    stop = threading.Event()

    def drive() -> None:
        while not stop.wait(TICK_S):
            fleet.tick()

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    try:
        yield fleet, served
    finally:
        stop.set()
        driver.join(timeout=5)
        for server in servers:
            server.shutdown()
            server.server_close()


def prometheus_config(rules_file: Path, served: list[tuple[Target, str]]) -> dict[str, Any]:
    jobs: dict[str, list[dict[str, Any]]] = {}
    for target, address in served:
        jobs.setdefault(target.job, []).append({"targets": [address], "labels": target.labels})
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules_file)],
        "scrape_configs": [
            {"job_name": job, "static_configs": configs} for job, configs in jobs.items()
        ],
    }


def firing(prometheus: str) -> dict[tuple[str, str], set[str]]:
    """(alert, subject label) → subjects firing now, for every alert Prometheus holds."""
    body = httpx.get(prometheus + "/api/v1/alerts", timeout=10).json()
    found: dict[tuple[str, str], set[str]] = {key: set() for key in EXPECTED}
    for alert in body["data"]["alerts"]:
        if alert["state"] != "firing":
            continue
        name = alert["labels"]["alertname"]
        keys = [key for key in EXPECTED if key[0] == name]
        assert keys, f"unexpected alert {alert['labels']}"
        found[keys[0]].add(alert["labels"].get(keys[0][1], "<missing>"))
    return found


def wait_for(condition: Callable[[], bool], timeout_s: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(what())
        time.sleep(1)


def test_every_alert_fires_for_its_condition_and_not_for_healthy_twins(
    k8s_bin: Path,
    binaries: dict[str, str],
    exporters: tuple[Fleet, list[tuple[Target, str]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for path in ALERT_FILES:  # the source file, as the chart ships it
        promtool_check(binaries["promtool"], path)
    defaults = alert_fors(rendered_rules(k8s_bin / "helm", {}))
    assert {name for name, _ in EXPECTED} == set(defaults)
    assert all(value != "1s" for value in defaults.values())
    rules = rendered_rules(k8s_bin / "helm", dict.fromkeys(defaults, "1s"))
    assert set(alert_fors(rules).values()) == {"1s"}
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rules, sort_keys=False))
    promtool_check(binaries["promtool"], rules_file)

    _fleet, served = exporters
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(prometheus_config(rules_file, served)))
    port = free_port()
    prometheus = f"http://127.0.0.1:{port}"
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                binaries["prometheus"],
                f"--config.file={config_file}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return httpx.get(prometheus + "/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 60, lambda: "prometheus not ready:\n" + log.read_text()[-3000:])
        started = time.monotonic()
        last: dict[tuple[str, str], set[str]] = {}

        def all_fire() -> bool:
            nonlocal last
            last = firing(prometheus)
            return last == EXPECTED

        wait_for(all_fire, FIRING_TIMEOUT_S, lambda: f"firing {last}, expected {EXPECTED}")
        with capsys.disabled():
            print(f"\nall {len(EXPECTED)} alerts firing after {time.monotonic() - started:.0f}s")
        time.sleep(5)  # a few more evaluations: still exactly the sick subjects
        assert firing(prometheus) == EXPECTED
    finally:
        proc.terminate()
        proc.wait(timeout=30)
