"""The whole control plane on one machine: gateway and autoscalers in process, engines as
child processes. The same code paths as on Kubernetes, minus the API server.

Secure by default, as on Kubernetes: every engine listens on 127.0.0.1 only and requires a
key generated for this run (handed to each engine in its environment, never on its command
line, where `ps` would show it), which only the gateway holds; the gateway serves with the
head and body deadlines of `servefleet.api.http_protocol`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn

from servefleet.api.batches import BatchConfig
from servefleet.api.disaggregation import Role
from servefleet.api.engines import engine_adapter
from servefleet.api.gateway_config import GatewayConfig
from servefleet.api.gateway_render import ResolvedSecretKeys, render_gateway_config
from servefleet.api.http_protocol import BoundedHeadProtocol
from servefleet.api.llmadapter import LLMAdapter
from servefleet.api.llmdeployment import LLMDeployment, LLMDeploymentSpec, SecretKeyRef
from servefleet.autoscaler.controller import DeploymentAutoscaler
from servefleet.autoscaler.observe import InProcessGatewaySource, observe_deployment
from servefleet.autoscaler.signals import Observation
from servefleet.autoscaler.spec import targets_from_spec
from servefleet.autoscaler.telemetry import AutoscalerMetrics
from servefleet.gateway.app import Gateway

from .actuator import LocalActuator
from .capacity import LocalCapacity
from .engine_command import ENGINE_HOST, engine_command
from .prefill_pool import prefill_endpoints, prefill_pool_name, reserve_prefill_ports
from .supervisor import DeploymentSupervisor
from .tenants import LocalTenants

log = logging.getLogger(__name__)

EngineCommand = Callable[[LLMDeploymentSpec, str, int], list[str]]

# The run's engine key, as the gateway config's Secret reference names it (never a Secret).
ENGINE_KEY_REF = SecretKeyRef(name="servefleet-local-engine", key="api-key")
# Where the internal API may point replicas: the engines listen nowhere else.
LOOPBACK_NETWORKS = [f"{ENGINE_HOST}/32"]


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers: `servefleet up` owns Ctrl-C and stops the
    engines before the gateway."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class LocalOptions:
    log_dir: Path
    host: str = "127.0.0.1"
    port: int = 8080
    # None: the real engine (`engine_command.engine_command`, with `volumes`); tests fake it.
    engine_command: EngineCommand | None = None
    stop_timeout_s: float = 5.0
    env: dict[str, str] | None = None
    # The gateway's socket, bound by the caller before anything starts (a busy port is then
    # one line, not a half-started plane); None: uvicorn binds host:port itself.
    listener: socket.socket | None = None
    # Folders standing for PersistentVolumeClaims (`--volume CLAIM=DIR`): pvc sources of
    # models and adapters are read there (`servefleet.api.local_volumes`).
    volumes: dict[str, str] = field(default_factory=dict)
    # The Batch API's files, batches and journals (`servefleet up --batch-dir`); None: off.
    batch_dir: Path | None = None

    def engine_argv(
        self, spec: LLMDeploymentSpec, port: int, role: Role | None = None
    ) -> list[str]:
        """One replica's command line, listening on loopback at `port` (`role`: that of a
        disaggregated pool; a test's fake command runs the same for both pools)."""
        if self.engine_command is not None:
            return self.engine_command(spec, ENGINE_HOST, port)
        return engine_command(spec, ENGINE_HOST, port, volumes=self.volumes, role=role)


@dataclass
class LocalControlPlane:
    deployments: list[LLMDeployment]
    tenants: LocalTenants
    options: LocalOptions
    adapters: list[LLMAdapter] = field(default_factory=list)
    """LLMAdapters served on `deployments` (checked by `local.adapters` before the start)."""
    metrics: AutoscalerMetrics = field(default_factory=AutoscalerMetrics)
    capacity: LocalCapacity = field(default_factory=LocalCapacity)
    supervisors: dict[str, DeploymentSupervisor] = field(default_factory=dict)
    prefill_supervisors: dict[str, DeploymentSupervisor] = field(default_factory=dict)
    """Disaggregated deployments' prefill pools, by deployment name."""
    prefill_ports: dict[str, list[int]] = field(default_factory=dict)
    autoscalers: dict[str, DeploymentAutoscaler] = field(default_factory=dict)
    gateway: Gateway | None = None
    _server: uvicorn.Server | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _client: httpx.AsyncClient | None = None
    # A fresh key per run: engines require it, only the gateway sends it.
    engine_key: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.options.host}:{self.options.port}/v1"

    def gateway_config(self) -> GatewayConfig:
        """The gateway's config: engines behind this run's key, replicas on loopback only."""
        opts = self.options

        def resolve(ref: SecretKeyRef) -> str | None:
            return self.engine_key if ref == ENGINE_KEY_REF else self.tenants.resolve(ref)

        config = render_gateway_config(
            self.deployments,
            endpoints={},
            key_source=ResolvedSecretKeys(resolve),
            engine_keys={dep.name: ENGINE_KEY_REF for dep in self.deployments},
            host=opts.host,
            port=opts.port,
            allowed_replica_networks=LOOPBACK_NETWORKS,
            adapters=self.adapters,
            local_volumes=opts.volumes,
            prefill_endpoints=prefill_endpoints(self.prefill_ports),
        )
        if opts.batch_dir is not None:
            config.batch = BatchConfig(store_dir=str(opts.batch_dir))
        return config

    def engine_env(self, spec: LLMDeploymentSpec) -> dict[str, str]:
        """An engine's environment: ours (or the options'), plus the key it must require."""
        env = dict(os.environ if self.options.env is None else self.options.env)
        env[engine_adapter(spec.engine.kind).api_key_env] = self.engine_key
        return env

    async def start(self) -> None:
        opts = self.options
        self.prefill_ports = reserve_prefill_ports(self.deployments)
        gateway = Gateway(self.gateway_config())
        self.gateway = gateway
        self._server = _QuietServer(
            uvicorn.Config(
                gateway,
                host=opts.host,
                port=opts.port,
                log_config=None,
                log_level="warning",
                http=BoundedHeadProtocol,  # slow or huge heads and slow bodies are cut
            )
        )
        sockets = [opts.listener] if opts.listener is not None else None
        self._tasks.append(asyncio.create_task(self._server.serve(sockets), name="gateway"))
        while not self._server.started:
            if self._tasks[0].done():
                self._tasks[0].result()
                raise RuntimeError(f"gateway could not listen on {opts.host}:{opts.port}")
            await asyncio.sleep(0.05)
        self._client = httpx.AsyncClient(timeout=2.0)
        source = InProcessGatewaySource(gateway.deployment_stats)
        for dep in self.deployments:
            self._start_deployment(dep, gateway, source)

    def _start_deployment(
        self, dep: LLMDeployment, gateway: Gateway, source: InProcessGatewaySource
    ) -> None:
        opts, spec, name = self.options, dep.spec, dep.name
        role: Role | None = "decode" if spec.disaggregation is not None else None
        if spec.disaggregation is not None:
            self._start_prefill_pool(dep)
        supervisor = DeploymentSupervisor(
            name,
            lambda port: opts.engine_argv(spec, port, role),
            host=ENGINE_HOST,  # whatever address the gateway listens on
            log_dir=opts.log_dir,
            on_change=lambda endpoints, ready: gateway.set_replicas(name, endpoints, ready),
            env=self.engine_env(spec),
            ready_timeout_s=spec.engine.startup_timeout_seconds,
            stop_timeout_s=opts.stop_timeout_s,
        )
        supervisor.scale(spec.desired_replicas())
        self.supervisors[name] = supervisor
        self.capacity.add(name, spec, supervisor)
        self._tasks.append(asyncio.create_task(supervisor.run(), name=f"supervise-{name}"))
        if not spec.autoscaling.enabled:
            return

        async def observe() -> Observation:
            assert self._client is not None
            stats = (await source.deployments()).get(name)
            observed = await observe_deployment(
                client=self._client,
                gateway=stats,
                replicas=supervisor.targets(),
                engine_kind=spec.engine.kind,
                model_name=spec.model.name,
            )
            # One machine: more engines than fit would only share the same cores.
            free = self.capacity.free_replicas(name)
            return observed.model_copy(update={"free_capacity": free})

        autoscaler = DeploymentAutoscaler(
            name, targets_from_spec(spec), observe, LocalActuator(supervisor), self.metrics
        )
        self.autoscalers[name] = autoscaler
        self._tasks.append(
            asyncio.create_task(
                self._autoscale(autoscaler, spec.autoscaling.interval), name=f"autoscale-{name}"
            )
        )

    def _start_prefill_pool(self, dep: LLMDeployment) -> None:
        """The prefill processes, on the ports the gateway's config names (`prefill_pool`)."""
        opts, spec, block = self.options, dep.spec, dep.spec.disaggregation
        assert block is not None
        supervisor = DeploymentSupervisor(
            prefill_pool_name(dep.name),
            lambda port: opts.engine_argv(spec, port, "prefill"),
            host=ENGINE_HOST,
            log_dir=opts.log_dir,
            env=self.engine_env(spec),
            ready_timeout_s=spec.engine.startup_timeout_seconds,
            stop_timeout_s=opts.stop_timeout_s,
            ports=self.prefill_ports[dep.name],
        )
        supervisor.scale(block.prefill.desired_replicas())
        self.prefill_supervisors[dep.name] = supervisor
        self.capacity.add(prefill_pool_name(dep.name), spec, supervisor)
        task = asyncio.create_task(supervisor.run(), name=f"supervise-{supervisor.name}")
        self._tasks.append(task)

    def _warm_counts(self) -> list[tuple[int, int]]:
        """(ready, wanted) of every pool: each deployment's, and its prefill pool's."""
        counts = []
        for dep in self.deployments:
            pools = [(self.supervisors[dep.name], dep.spec.desired_replicas())]
            block = dep.spec.disaggregation
            if block is not None:
                pools.append((self.prefill_supervisors[dep.name], block.prefill.desired_replicas()))
            for sup, wanted in pools:
                counts.append((sum(1 for r in sup.live() if r.ready_at is not None), wanted))
        return counts

    @staticmethod
    async def _autoscale(autoscaler: DeploymentAutoscaler, interval: float) -> None:
        while True:
            await autoscaler.tick(time.monotonic())
            await asyncio.sleep(interval)

    async def wait_warm(self, timeout_s: float | None = None) -> None:
        """Until every deployment has its warm minimum ready (and its prefill pool)."""

        async def warm() -> None:
            while not all(ready >= wanted for ready, wanted in self._warm_counts()):
                await asyncio.sleep(0.2)

        await asyncio.wait_for(warm(), timeout_s)

    async def stop(self) -> None:
        """Stop autoscalers, then every engine process, then the gateway."""
        for task in self._tasks[1:]:
            task.cancel()
        for task in self._tasks[1:]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        pools = [*self.supervisors.values(), *self.prefill_supervisors.values()]
        await asyncio.gather(*(s.stop() for s in pools))
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._tasks[0], self.options.stop_timeout_s)
        if self._client is not None:
            await self._client.aclose()


def banner(plane: LocalControlPlane) -> str:
    key = plane.tenants.first_key() or "<your key>"
    base = plane.base_url
    model = plane.deployments[0].spec.model.name
    lines = ["servefleet local mode"]
    for dep in plane.deployments:
        pool = dep.spec.pool
        lines.append(
            f"  {dep.name}: model {dep.spec.model.name}, replicas "
            f"{pool.min_replicas}..{pool.max_replicas} (warm {dep.spec.desired_replicas()})"
        )
        block = dep.spec.disaggregation
        if block is not None:
            lines.append(
                f"    prefill pool: {block.prefill.desired_replicas()} replicas "
                f"(prompts of {block.threshold}+ uncached tokens; this pool decodes)"
            )
        served = [
            a.served_name
            for a in plane.adapters
            if (a.namespace, a.spec.deployment) == (dep.namespace, dep.name)
        ]
        if served:
            lines.append(f"    adapters (loaded on demand): {', '.join(served)}")
    if plane.tenants.demo_key is not None:
        lines.append("  tenant: demo (created for this run; its key is below)")
    lines += [
        "",
        f"export OPENAI_BASE_URL={base}",
        f"export OPENAI_API_KEY={key}",
        "",
        'curl -s "$OPENAI_BASE_URL/chat/completions" -H "Authorization: Bearer $OPENAI_API_KEY" '
        "-H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}\'',
        "",
        'python -c "from openai import OpenAI; print(OpenAI().chat.completions.create('
        f"model='{model}', messages=[{{'role': 'user', 'content': 'Hello!'}}])"
        '.choices[0].message.content)"',
        "",
        f"engine logs: {plane.options.log_dir}   (Ctrl-C stops everything)",
    ]
    return "\n".join(lines)
