"""Every query of the chart's Grafana dashboards returns data from a real Prometheus.

One real engine (SmolLM2, with --enable-lora), a real gateway process in front of it (plus a
spill-over deployment to an in-test OpenAI stand-in, and a Redis URL nobody listens on, so the
spill-over and degraded-limits series exist too), the real autoscaler loop in this process
(its actuator only records, there is no cluster to scale), and `prometheus` (Debian package)
scraping the three every second. A real PEFT adapter is made here (`make_adapters`, random
weights) and listed on the gateway's deployment, which loads it on the engine on its first
request, so the adapter panels have series. After a few requests, every panel expression and
every template-variable query is evaluated through `/api/v1/query` with Grafana's variables
substituted.

    uv run pytest e2e/test_dashboards.py -s
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from procs import free_port as _free_port
from procs import servefleet_command as _servefleet
from prometheus_client import start_http_server

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayAdapter,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    RedisConfig,
    SecretValueRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.llmdeployment import (
    PoolSpec,
    SpilloverSpec,
    TenantLimits,
)
from servefleet.autoscaler.controller import DeploymentAutoscaler
from servefleet.autoscaler.observe import (
    HttpGatewaySource,
    ReplicaTarget,
    observe_deployment,
)
from servefleet.autoscaler.policy import Decision
from servefleet.autoscaler.signals import Observation, ReplicaState
from servefleet.autoscaler.targets import ScalingTargets
from servefleet.autoscaler.telemetry import AutoscalerMetrics
from servefleet.bench.fake_upstream import FakeOpenAI
from servefleet.bench.processes import serve_in_thread

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "charts" / "servefleet" / "files" / "dashboards"
MODEL = "smollm2-135m-instruct"
DEPLOYMENT = "smollm2"
SPILL_MODEL = "hosted-model"
ADAPTER = "acme-tuned"  # a LoRA adapter on MODEL, loaded by the gateway on first use
ADAPTER_RANK = 8
KEY = "key-acme"
INTERNAL_KEY = "sk-internal-dashboards"  # the gateway's internal port (metrics, stats)
READY_TIMEOUT_S = float(os.environ.get("SERVEFLEET_E2E_READY_S", "240"))
RATE_INTERVAL = "1m"
VARIABLE = re.compile(r"\$\{?(\w+)(?::\w+)?\}?")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@dataclass
class Children:
    logs: Path
    started: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        log = self.logs / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own group: killed with everything it started
            )
        child = Child(name, proc, log)
        self.started.append(child)
        return child

    def stop_all(self) -> None:
        for child in self.started:
            child.stop()


def _wait_http(child: Child, url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            pytest.fail(f"{child.name} exited with {child.proc.returncode}:\n{child.tail()}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{child.name}: {url} not ready in time:\n{child.tail()}")


def _wait_exit(child: Child, deadline: float) -> None:
    while child.proc.poll() is None:
        if time.monotonic() > deadline:
            pytest.fail(f"{child.name}: still running:\n{child.tail()}")
        time.sleep(0.5)
    if child.proc.returncode != 0:
        pytest.fail(f"{child.name} exited with {child.proc.returncode}:\n{child.tail()}")


def gateway_config(
    engine_url: str, spill_url: str, dead_redis: str, adapter_path: Path
) -> GatewayConfig:
    access = [TenantAccess(name="acme")]
    return GatewayConfig(
        host="127.0.0.1",
        # Nobody listens there: limits run per replica and the degraded series fill in.
        redis=RedisConfig(url=dead_redis, timeout_seconds=0.1),
        tenants=[
            GatewayTenant(
                name="acme",
                api_keys=[ApiKeyRef(sha256=hash_api_key(KEY))],
                limits=TenantLimits(requests_per_minute=10_000),
            )
        ],
        deployments=[
            GatewayDeployment(
                name=DEPLOYMENT,
                model=MODEL,
                endpoints=[engine_url],
                pool=PoolSpec(per_replica_concurrency=4),
                tenants=access,
                adapters=[GatewayAdapter(name=ADAPTER, path=str(adapter_path))],
                upstream_timeout_seconds=180,
            ),
            # No replicas at all: every request spills over to the hosted API.
            GatewayDeployment(
                name="hosted",
                model=SPILL_MODEL,
                tenants=access,
                spillover=SpilloverSpec.model_validate(
                    {
                        "enabled": True,
                        "baseURL": spill_url + "/v1",
                        "model": "fake",
                        "apiKeySecretRef": {"name": "hosted", "key": "key"},
                        "when": {"noReadyReplica": True},
                    }
                ),
                spillover_api_key=SecretValueRef(env="E2E_SPILL_KEY"),
            ),
        ],
    )


class RecordingActuator:
    """There is no cluster to scale here; the decisions are what the panels show."""

    def __init__(self) -> None:
        self.decisions: list[Decision] = []

    async def apply(self, deployment: str, decision: Decision, observation: Observation) -> None:
        self.decisions.append(decision)


async def autoscaler_ticks(
    metrics: AutoscalerMetrics, gateway_url: str, engine_url: str, ticks: int
) -> list[Decision]:
    """The real autoscaler loop (observe the gateway and engine, decide, record) for one pool."""
    actuator = RecordingActuator()
    async with httpx.AsyncClient(timeout=5.0) as http:
        source = HttpGatewaySource(gateway_url, http, INTERNAL_KEY)

        async def observe() -> Observation:
            stats = (await source.deployments()).get(DEPLOYMENT)
            replicas = [
                ReplicaTarget(name="engine-0", base_url=engine_url, state=ReplicaState.READY)
            ]
            return await observe_deployment(
                client=http, gateway=stats, replicas=replicas, model_name=MODEL
            )

        targets = ScalingTargets(min_replicas=1, max_replicas=3, target_per_replica=4)
        scaler = DeploymentAutoscaler(DEPLOYMENT, targets, observe, actuator, metrics)
        for _ in range(ticks):
            await scaler.tick(time.monotonic())
            await asyncio.sleep(0.5)
    return actuator.decisions


def prometheus_config(
    targets: dict[str, str], credentials: dict[str, Path] | None = None
) -> dict[str, Any]:
    """Scrape every target each second; a job in `credentials` sends the Bearer key in that
    file (the gateway's internal port, like the chart's ServiceMonitor)."""
    jobs: list[dict[str, Any]] = []
    for job, target in targets.items():
        config: dict[str, Any] = {
            "job_name": job,
            "metrics_path": "/metrics",
            "static_configs": [{"targets": [target]}],
        }
        if credentials and job in credentials:
            config["authorization"] = {"credentials_file": str(credentials[job])}
        jobs.append(config)
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": jobs,
    }


def substitute(expr: str) -> str:
    """Grafana's variables → what Prometheus reads: every template variable matches all."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    return VARIABLE.sub(lambda m: m.group(0) if m.group(1).startswith("__") else ".*", expr)


def variable_as_query(query: str) -> str:
    """`label_values(metric{...}, label)` as the instant query Grafana's lookup amounts to."""
    found = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\)\s*", query)
    assert found, f"unsupported variable query {query}"
    return f"count by ({found.group(2)}) ({found.group(1)})"


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel or variable, PromQL) of everything the dashboards ask Prometheus."""
    queries: list[tuple[str, str, str]] = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
                queries.append((path.name, f"${var['name']}", variable_as_query(query)))
        for panel in board["panels"]:
            for inner in [panel, *panel.get("panels", [])]:
                for target in inner.get("targets", []):
                    queries.append((path.name, inner["title"], target["expr"]))
    return queries


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.fail("prometheus is not installed (Debian: apt-get install -y prometheus)")
    return found


def test_every_dashboard_query_returns_series(prometheus_bin: str, tmp_path: Path) -> None:
    children = Children(tmp_path)
    autoscaler_server = None
    try:
        with serve_in_thread(FakeOpenAI()) as spill_url:
            engine_port, gateway_port, internal_port = _free_port(), _free_port(), _free_port()
            engine_url = f"http://127.0.0.1:{engine_port}"
            gateway_url = f"http://127.0.0.1:{gateway_port}"
            # /metrics and the stats the autoscaler reads: the gateway's internal port only.
            internal_url = f"http://127.0.0.1:{internal_port}"
            engine = children.start(
                "engine",
                [
                    *_servefleet(),
                    "engine",
                    "--model",
                    MODEL,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(engine_port),
                    "--max-num-seqs",
                    "4",
                    "--threads",
                    "1",
                    "--kv-cache-memory",
                    "128MiB",
                    "--enable-lora",
                    "--max-loras",
                    "2",
                    "--max-lora-rank",
                    str(ADAPTER_RANK),
                ],
            )
            # A real PEFT adapter (random A and B), made while the engine starts.
            adapters = tmp_path / "adapters"
            maker = children.start(
                "make-adapters",
                [
                    sys.executable,
                    "-m",
                    "servefleet.bench.make_adapters",
                    "--out",
                    str(adapters),
                    "--memorized",
                    "0",
                    "--random",
                    "1",
                    "--rank",
                    str(ADAPTER_RANK),
                ],
            )
            _wait_exit(maker, time.monotonic() + READY_TIMEOUT_S)
            (adapter_path,) = adapters.iterdir()
            dead_redis = f"redis://127.0.0.1:{_free_port()}/0"
            config = gateway_config(engine_url, spill_url, dead_redis, adapter_path)
            config_file = tmp_path / "gateway.yaml"
            config_file.write_text(config.model_dump_json(by_alias=True, exclude_none=True))
            key_file = tmp_path / "internal-key"
            key_file.write_text(INTERNAL_KEY)
            gateway = children.start(
                "gateway",
                [
                    *_servefleet(),
                    "gateway",
                    "--config",
                    str(config_file),
                    "--port",
                    str(gateway_port),
                    "--internal-port",
                    str(internal_port),
                    "--internal-api-key-file",
                    str(key_file),
                ],
                env={**os.environ, "E2E_SPILL_KEY": "spill-secret"},
            )
            _wait_http(engine, engine_url + "/ready", time.monotonic() + READY_TIMEOUT_S)
            _wait_http(gateway, gateway_url + "/ready", time.monotonic() + 60)

            autoscaler = AutoscalerMetrics()
            autoscaler_port = _free_port()
            autoscaler_server, _thread = start_http_server(
                autoscaler_port, addr="127.0.0.1", registry=autoscaler.registry
            )

            prom_port = _free_port()
            prometheus = f"http://127.0.0.1:{prom_port}"
            targets = {
                "engine": f"127.0.0.1:{engine_port}",
                "gateway": f"127.0.0.1:{internal_port}",
                "autoscaler": f"127.0.0.1:{autoscaler_port}",
            }
            prom_file = tmp_path / "prometheus.yml"
            scrape = prometheus_config(targets, {"gateway": key_file})
            prom_file.write_text(yaml.safe_dump(scrape))
            prom = children.start(
                "prometheus",
                [
                    prometheus_bin,
                    f"--config.file={prom_file}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                    "--storage.tsdb.retention.time=1h",
                ],
            )
            _wait_http(prom, prometheus + "/-/ready", time.monotonic() + 60)
            deadline = time.monotonic() + 60
            while len([s for s in query(prometheus, "up == 1")]) < len(targets):
                assert time.monotonic() < deadline, f"targets not up:\n{prom.tail()}"
                time.sleep(0.5)

            # Traffic while Prometheus watches, so rates and quantiles have data in the window.
            headers = {"authorization": f"Bearer {KEY}"}
            with httpx.Client(base_url=gateway_url, headers=headers, timeout=180) as client:
                for i in range(4):
                    answer = client.post(
                        "/v1/chat/completions",
                        json={
                            "model": MODEL,
                            "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
                            "max_tokens": 4,
                            "stream": i % 2 == 1,
                        },
                    )
                    assert answer.status_code == 200, answer.text
                    assert answer.headers["x-servefleet-route"] == "pool"
                spilled = client.post(
                    "/v1/chat/completions",
                    json={"model": SPILL_MODEL, "messages": [{"role": "user", "content": "hi"}]},
                )
                assert spilled.status_code == 200, spilled.text
                assert spilled.headers["x-servefleet-route"] == "spillover"
                # The adapter panels: the gateway loads it on the engine for the first request
                # (the engine's load series), the second finds it there (no second load).
                for i in range(2):
                    tuned = client.post(
                        "/v1/chat/completions",
                        json={
                            "model": ADAPTER,
                            "messages": [{"role": "user", "content": f"Name {i + 2} colours."}],
                            "max_tokens": 4,
                            "stream": i == 1,
                        },
                    )
                    assert tuned.status_code == 200, tuned.text
                    assert tuned.headers["x-servefleet-route"] == "pool"
            # An invalid request straight to the engine: the rejected series (HTTP 400).
            invalid = httpx.post(engine_url + "/v1/chat/completions", json={"model": MODEL})
            assert invalid.status_code == 400

            decisions = asyncio.run(autoscaler_ticks(autoscaler, internal_url, engine_url, 3))
            assert decisions and all(d.desired >= 1 for d in decisions)
            time.sleep(4)  # a few more scrapes after the last request
            loads = query(prometheus, "sum(servefleet_engine_lora_loads_total)")
            assert [float(r["value"][1]) for r in loads] == [1.0], f"one load: {loads}"

            failures: list[str] = []
            report: list[str] = []
            for board, title, expr in dashboard_queries():
                promql = substitute(expr)
                result = query(prometheus, promql)
                values = [float(r["value"][1]) for r in result]
                finite = [v for v in values if math.isfinite(v)]
                report.append(f"{board} | {title}: {len(result)} series, {finite[:3]}")
                if not result:
                    failures.append(f"{board} / {title}: no series for {promql}")
                elif not finite:
                    failures.append(f"{board} / {title}: only NaN for {promql}")
            # The whole report only when something is missing: a passing run stays quiet.
            assert not failures, "\n".join([*failures, "", *report])
    finally:
        if autoscaler_server is not None:
            autoscaler_server.shutdown()
            autoscaler_server.server_close()
        children.stop_all()
