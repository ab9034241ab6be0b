"""A whole serving stack as real processes, for fault scenarios: redis-server, engines on the
real model, gateways sharing the limits in Redis; each part can be killed and started again.

The fault suite (`fault_suite`) and its short run in e2e both start it, so what CI checks and
what `make soak` measures are the same processes in the same shape.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from servefleet.api.builtin_models import BUILTIN_MODELS
from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    RedisConfig,
    RoutingConfig,
    SecretValueRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.llmdeployment import AdmissionSpec, PoolSpec, TenantLimits
from servefleet.bench.processes import free_port, servefleet_command

MODEL = next(iter(BUILTIN_MODELS))  # the real model every "serves a model" claim uses
DEPLOYMENT = "faults"
TENANTS = ("alpha", "beta")  # generous limits, kept in Redis
CAPPED_TENANT = "gamma"  # also a cap on requests in flight, shared by the gateways
# The gateways' internal port (metrics, stats, replica lists) answers only this Bearer key.
INTERNAL_KEY = "sk-internal-fault-suite"
# Small engines that share two cores: one thread each, a few sequences, a small KV cache.
ENGINE_ARGS = ["--threads", "1", "--kv-cache-memory", "128MiB", "--drain-timeout", "30"]

# Gateways up and every engine seen ready by each: under a full CI machine (other e2e streams
# beside it) two gateways' probes once took over a minute to see two ready engines.
GATEWAYS_READY_S = 180.0


class StackError(RuntimeError):
    """A part of the stack did not start; the message carries its log's tail."""


def api_key(tenant: str) -> str:
    return f"key-{tenant}"


def internal_headers() -> dict[str, str]:
    return {"authorization": f"Bearer {INTERNAL_KEY}"}


@dataclass
class Part:
    """One process of the stack and where it answers."""

    name: str
    argv: list[str]
    url: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    internal_url: str = ""

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=timeout)

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class StackShape:
    """How big the stack is and how its gateway admits (per-replica slots = max sequences)."""

    engines: int = 2
    gateways: int = 1
    max_num_seqs: int = 4
    max_queue_depth: int = 16
    max_queue_wait_s: float = 10.0
    tokens_per_minute: int | None = 1_000_000  # generous, but kept in Redis
    max_concurrent_requests: int = 4  # CAPPED_TENANT's cap
    ready_timeout_s: float = 240.0


@dataclass
class Stack:
    """Start with `start()`, always `stop()` (a context manager does both)."""

    workdir: Path
    shape: StackShape = field(default_factory=StackShape)
    redis: Part | None = None
    engines: list[Part] = field(default_factory=list)
    gateways: list[Part] = field(default_factory=list)

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def parts(self) -> list[Part]:
        return [*self.engines, *self.gateways, *([self.redis] if self.redis else [])]

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.redis = self._redis_part()
        self.redis.start()
        for i in range(self.shape.engines):
            self.engines.append(self._engine_part(i))
            self.engines[-1].start()
        deadline = time.monotonic() + self.shape.ready_timeout_s
        for engine in self.engines:
            wait_ready(engine, deadline)
        config = self.workdir / "gateway.json"
        config.write_text(self.gateway_config().model_dump_json(by_alias=True, exclude_none=True))
        for i in range(self.shape.gateways):
            self.gateways.append(self._gateway_part(i, config))
            self.gateways[-1].start()
        deadline = time.monotonic() + GATEWAYS_READY_S
        for gateway in self.gateways:
            wait_ready(gateway, deadline)
            wait_for_replicas(gateway, self.engines, deadline)
            warm_up(gateway)

    def stop(self) -> None:
        for part in self.parts():
            part.stop()

    def _redis_part(self) -> Part:
        server = shutil.which("redis-server")
        if server is None:
            raise StackError("redis-server is not installed (Debian: apt-get install redis-server)")
        port = free_port()
        argv = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        return Part("redis", argv, f"redis://127.0.0.1:{port}/0", self.workdir / "redis.log")

    def _engine_part(self, index: int) -> Part:
        port = free_port()
        argv = [*servefleet_command(), "engine", "--model", MODEL]
        argv += ["--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS]
        argv += ["--max-num-seqs", str(self.shape.max_num_seqs)]
        log = self.workdir / f"engine-{index}.log"
        return Part(f"engine-{index}", argv, f"http://127.0.0.1:{port}", log)

    def spare_engine(self, index: int) -> Part:
        """A new engine on a port of its own, neither started nor in `engines` yet: a scale-up
        or a rolling update adds it once it is ready."""
        return self._engine_part(index)

    def publish_engines(self) -> None:
        """Give every live gateway the replica list `engines` now holds, as the local plane does
        when its replica set changes; the config file follows, so a restarted gateway agrees."""
        config = self.gateway_config()
        (self.workdir / "gateway.json").write_text(
            config.model_dump_json(by_alias=True, exclude_none=True)
        )
        update = {"endpoints": [e.url for e in self.engines]}
        for gateway in self.gateways:
            if gateway.alive():
                url = f"{gateway.internal_url}/internal/deployments/{DEPLOYMENT}/replicas"
                response = httpx.post(url, json=update, headers=internal_headers(), timeout=10)
                response.raise_for_status()

    def _gateway_part(self, index: int, config: Path) -> Part:
        port, internal = free_port(), free_port()
        argv = [*servefleet_command(), "gateway", "--config", str(config), "--port", str(port)]
        argv += ["--internal-port", str(internal)]
        log = self.workdir / f"gateway-{index}.log"
        part = Part(f"gateway-{index}", argv, f"http://127.0.0.1:{port}", log)
        part.internal_url = f"http://127.0.0.1:{internal}"
        return part

    def gateway_config(self) -> GatewayConfig:
        assert self.redis is not None
        generous = TenantLimits(tokens_per_minute=self.shape.tokens_per_minute)
        capped = generous.model_copy(
            update={"max_concurrent_requests": self.shape.max_concurrent_requests}
        )
        tenants = [
            GatewayTenant(
                name=t,
                api_keys=[ApiKeyRef(sha256=hash_api_key(api_key(t)))],
                limits=capped if t == CAPPED_TENANT else generous,
            )
            for t in (*TENANTS, CAPPED_TENANT)
        ]
        deployment = GatewayDeployment(
            name=DEPLOYMENT,
            model=MODEL,
            endpoints=[e.url for e in self.engines],
            tokenizer=MODEL,
            pool=PoolSpec(per_replica_concurrency=self.shape.max_num_seqs),
            admission=AdmissionSpec(
                max_queue_depth=self.shape.max_queue_depth,
                max_queue_wait=self.shape.max_queue_wait_s,
            ),
            tenants=[TenantAccess(name=t) for t in (*TENANTS, CAPPED_TENANT)],
            upstream_timeout_seconds=120,
        )
        key_file = self.workdir / "internal-key"
        key_file.write_text(INTERNAL_KEY)
        return GatewayConfig(
            host="127.0.0.1",
            redis=RedisConfig(url=self.redis.url, gateway_replicas=self.shape.gateways),
            tenants=tenants,
            deployments=[deployment],
            routing=RoutingConfig(probe_interval_seconds=1.0),
            internal_api_key=SecretValueRef(file=str(key_file)),
        )

    def restart_redis(self) -> None:
        """Start Redis again on the same port (after a kill), empty as a fresh server is."""
        assert self.redis is not None
        self.redis.stop()
        self.redis.start()


def wait_ready(part: Part, deadline: float) -> None:
    while time.monotonic() < deadline:
        if not part.alive():
            raise StackError(f"{part.name} exited:\n{part.tail()}")
        try:
            if httpx.get(part.url + "/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise StackError(f"{part.name} not ready in time:\n{part.tail()}")


def warm_up(gateway: Part) -> None:
    """One answered request, so a scenario's first figures are not the gateway's first use."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"authorization": f"Bearer {api_key(TENANTS[0])}"}
    response = httpx.post(
        gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=120
    )
    if response.status_code != 200:
        raise StackError(f"{gateway.name} answered {response.status_code}: {response.text[:300]}")


def wait_for_replicas(gateway: Part, engines: list[Part], deadline: float) -> None:
    """Until the gateway's probes have marked every engine ready; else what each engine's
    /ready answered and how long it took (the gateway's probes give up after 2 s)."""
    seen: dict[str, Any] = {}
    while time.monotonic() < deadline:
        seen = deployment_stats(gateway)
        if seen.get("ready_replicas") == len(engines):
            return
        time.sleep(0.2)
    raise StackError(
        f"{gateway.name} never saw {len(engines)} ready replicas (it reports "
        f"{seen.get('ready_replicas')}; engines: {'; '.join(_ready_answer(e) for e in engines)}):"
        f"\n{gateway.tail()}"
    )


def _ready_answer(engine: Part) -> str:
    started = time.monotonic()
    try:
        status: object = httpx.get(engine.url + "/ready", timeout=10).status_code
    except httpx.HTTPError as exc:
        status = repr(exc)
    return f"{engine.name} /ready {status} in {time.monotonic() - started:.1f}s"


def deployment_stats(gateway: Part) -> dict[str, Any]:
    url = gateway.internal_url + "/internal/deployments"
    body = httpx.get(url, headers=internal_headers(), timeout=10).json()
    return next((d for d in body if d["name"] == DEPLOYMENT), {})


def scrape(
    url: str, headers: dict[str, str] | None = None
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page, keyed by (name, sorted labels); sent with the fault
    stack's internal key unless `headers` say otherwise (engines' /metrics ignore it)."""
    sent = internal_headers() if headers is None else headers
    response = httpx.get(url + "/metrics", headers=sent, timeout=10)
    response.raise_for_status()
    text = response.text
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric_sum(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    return sum(
        value
        for (sample_name, sample_labels), value in samples.items()
        if sample_name == name and set(labels.items()) <= set(sample_labels)
    )
