"""The gateway as an ASGI application: lifecycle, the path table, and the current route table.

This module only wires: it hands each request to the module for its path (completions,
probes) together with the route table current when the request arrived, and nothing below it
calls back up. `/metrics` and `/internal/*` are not here: they are `internal`, the app of the
internal port (`internal_api`). Reconfiguring builds a new route table and swaps it in.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping

from servefleet.api.gateway_config import GatewayConfig
from servefleet.api.gateway_stats import DeploymentStats
from servefleet.api.openai_errors import OpenAIError
from servefleet.api.openai_version import version_body
from servefleet.api.openai_wire import headers_too_large, send_header_error
from servefleet.api.openapi_batches import with_batches
from servefleet.api.openapi_doc import OPENAPI_PATH, openapi_document
from servefleet.api.usage_query import prometheus_query
from servefleet.gateway.access_log import AccessLog
from servefleet.gateway.asgi import Receive, Scope, Send, header, respond
from servefleet.gateway.auth import KeyRing
from servefleet.gateway.batch_api import BatchApi, is_batch_path
from servefleet.gateway.batch_calls import call_in_process
from servefleet.gateway.batch_demand import OpenWork, due_by_pool
from servefleet.gateway.batch_lease import BatchLease, LocalLease, RedisBatchLease
from servefleet.gateway.batch_runner import BatchRunner
from servefleet.gateway.batch_stores import open_store
from servefleet.gateway.completion import CompletionHandler
from servefleet.gateway.endpoints import ENDPOINTS, model_card_body, tenant_document
from servefleet.gateway.errors import method_not_allowed
from servefleet.gateway.forward import Forwarder
from servefleet.gateway.internal_api import InternalApp
from servefleet.gateway.kv_route_metrics import KVRouteCollector
from servefleet.gateway.limits import Limiter
from servefleet.gateway.limits_failover import FailoverLimiter
from servefleet.gateway.metrics import GatewayMetrics
from servefleet.gateway.pd import with_prefill
from servefleet.gateway.pool import DeploymentPool
from servefleet.gateway.pool_tasks import PoolTasks
from servefleet.gateway.probes import ReplicaProber
from servefleet.gateway.relay import Relay
from servefleet.gateway.route_table import (
    RouteTable,
    build_route_table,
    make_limiter,
    plan_pools,
    share_spill_budgets,
)
from servefleet.gateway.upstream import UpstreamPool
from servefleet.kube import KubeAccess

log = logging.getLogger("servefleet.gateway.app")
INTERNAL_ERROR = OpenAIError(
    status=500,
    message="Internal error in the gateway (logged there).",
    type="server_error",
    code="internal_error",
)

# The tenant port's paths (/metrics is the internal port's); forwarded paths and models need a key.
USAGE_QUERY_TIMEOUT_S = 30.0  # one Prometheus query of /internal/usage
_KEYED_PATHS = [*ENDPOINTS, "/v1/models", "/v1/models/{model}"]
_GET_PATHS = frozenset({"/v1/models", "/version", "/health", "/ready", OPENAPI_PATH})
_OPENAPI = json.dumps(
    with_batches(
        tenant_document(
            openapi_document(
                "servefleet gateway",
                [*_KEYED_PATHS, "/version", "/health", "/ready", OPENAPI_PATH],
                _KEYED_PATHS,
            )
        )
    )
).encode()


class Gateway:
    """The tenant-facing endpoint of every deployment in a `GatewayConfig`."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        environ: Mapping[str, str] | None = None,
        limiter: Limiter | None = None,
        kubernetes: KubeAccess | None = None,
        clock: Callable[[], float] = time.monotonic,
        access_log: AccessLog | None = None,
    ) -> None:
        self._clock = clock
        self._environ = environ
        self.metrics = GatewayMetrics(config.tenant_series_limit)
        self.metrics.registry.register(KVRouteCollector(lambda: self.pools.values()))
        pools = plan_pools(config, {}, clock).pools
        self.table: RouteTable = build_route_table(config, pools, self.metrics, environ)
        self.limiter = limiter if limiter is not None else make_limiter(config, self.metrics, clock)
        share_spill_budgets(pools.values(), config, self.limiter, self.metrics, clock)
        self._internal_key = (
            config.internal_api_key.read(environ) if config.internal_api_key else None
        )
        if self._internal_key == "":
            raise ValueError("internal_api_key is empty")
        self._upstream = UpstreamPool()
        self._completions = CompletionHandler(
            self.limiter,
            Forwarder(self._upstream, self.metrics, Relay(clock)),
            self.metrics,
            clock,
            access_log,
        )
        usage = config.usage_prometheus_url
        self.internal = InternalApp(
            lambda: self.table,
            self.render_metrics,
            self._internal_key,
            prometheus_query(usage, USAGE_QUERY_TIMEOUT_S) if usage else None,
        )
        """The ASGI app of the internal port: /metrics and /internal/* (never the tenant port)."""
        self._batches = self._batch_api(config)
        self._batch_task: asyncio.Task[None] | None = None
        self._prober = ReplicaProber(clock)
        self._pool_tasks = PoolTasks(kubernetes)
        self._probe_task: asyncio.Task[None] | None = None
        self._lease_task: asyncio.Task[None] | None = None  # renews Redis concurrency leases
        self._ready = False

    def _batch_api(self, config: GatewayConfig) -> BatchApi | None:
        """The Batch API when configured: its lines go to the completion handler, with the
        route table current when each line starts."""
        if config.batch is None:
            return None
        store = open_store(config.batch)

        def complete(scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
            endpoint = ENDPOINTS[scope["path"]]
            return self._completions.handle(self.table, scope, receive, send, endpoint)

        runner = BatchRunner(
            store,
            lambda tenant, path, body: call_in_process(complete, tenant, path, body),
            concurrency=config.batch.line_concurrency,
            retry_s=config.batch.retry_seconds,
            on_work=self._publish_batch_work,
            batch_slots=self._batch_slots,
            lease=self._batch_lease(config),
        )
        return BatchApi(store, runner, config.batch.max_file_bytes)

    def _batch_lease(self, config: GatewayConfig) -> BatchLease:
        """With Redis, replicas over one store take turns per batch; alone, always ours."""
        if config.redis is None or not isinstance(self.limiter, FailoverLimiter):
            return LocalLease()
        return RedisBatchLease(self.limiter.primary.client, key_prefix=config.redis.key_prefix)

    def _publish_batch_work(self, works: list[OpenWork]) -> None:
        """Each deployment's share of the open batches' lines, for its stats."""

        def route_of(tenant: str, model: str) -> tuple[str, float | None] | None:
            route = self.table.routes.get((tenant, model))
            if route is None:
                return None
            limits = [s.policy.requests_per_minute for s in route.scopes]
            per_minute = min((n for n in limits if n is not None), default=None)
            return route.pool.name, None if per_minute is None else per_minute / 60.0

        wall_now = time.time()
        due = due_by_pool(works, route_of, wall_now)
        for name, pool in self.table.pools.items():
            pool.set_batch_due(due.get(name, []), wall_now)

    def _batch_slots(self) -> int:
        """Slots the pools' ready replicas leave batch requests: lines worth running at once."""
        return sum(pool.batch_slots() for pool in self.table.pools.values())

    # -- what the current table says -------------------------------------------------------
    @property
    def config(self) -> GatewayConfig:
        return self.table.config

    @property
    def pools(self) -> Mapping[str, DeploymentPool]:
        return self.table.pools

    @property
    def keys(self) -> KeyRing:
        return self.table.keys

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._prober.open()
        interval = self.config.routing.probe_interval_seconds
        pools = lambda: with_prefill(self.table.pools.values())  # noqa: E731 - the table now
        self._probe_task = asyncio.create_task(
            self._prober.run(pools, interval), name="gateway-probes"
        )
        if isinstance(self.limiter, FailoverLimiter):
            self._lease_task = asyncio.create_task(
                self.limiter.keep_leases(), name="gateway-leases"
            )
        for pool in with_prefill(self.pools.values()):
            self._pool_tasks.start(pool)
        if self._batches is not None:
            self._batch_task = asyncio.create_task(self._batches.runner.run(), name="batches")
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        if self._batch_task is not None:  # lines in flight run again after a restart
            self._batch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._batch_task
            self._batch_task = None
        if self._batches is not None:  # not left to expire: another replica takes them now
            await self._batches.runner.release_leases()
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._probe_task
            self._probe_task = None
        if self._lease_task is not None:
            self._lease_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._lease_task
            self._lease_task = None
        await self._pool_tasks.stop()
        await self._prober.close()
        self._upstream.close()
        await self.limiter.close()

    async def probe_once(self) -> None:
        """Ask every replica's /ready once (tests drive probing by hand with this)."""
        await self._prober.probe_once(with_prefill(self.pools.values()))

    def reconfigure(self, config: GatewayConfig) -> None:
        """Swap in new tenants and deployments without a restart (routes from Kubernetes).

        Everything is built before anything is swapped, so a bad config (a missing key file)
        raises ValueError and leaves the gateway as it was. A pool whose settings did not
        change is kept with its queue, replicas and measurements (a tenant change only
        updates who may use it); a changed pool is replaced and inherits its replicas and
        measurements, while requests already queued or running on the old one finish there.
        The limiter is kept, so windows carry over and a new limit applies to the running one.
        """
        if config.redis != self.config.redis or config.routing != self.config.routing:
            raise ValueError("redis and routing settings cannot change without a restart")
        changes = plan_pools(config, self.pools, self._clock)
        table = build_route_table(config, changes.pools, self.metrics, self._environ)
        # Commit: nothing below can fail on bad input.
        changes.apply()
        self.table = table
        share_spill_budgets(changes.created, config, self.limiter, self.metrics, self._clock)
        for pool in with_prefill(changes.gone):
            self._pool_tasks.cancel(pool.name)
            if pool.name not in changes.pools:
                self.metrics.forget_pool(pool.stats())
        if self._probe_task is not None:
            for pool in with_prefill(changes.created):
                self._pool_tasks.start(pool)

    # -- in-process API (local mode) -------------------------------------------------------
    def set_replicas(
        self, deployment: str, endpoints: Iterable[str], ready: Iterable[str] | None = None
    ) -> None:
        """Replace a deployment's replica list (local mode's supervisor calls this)."""
        pool = self.pools.get(deployment)
        if pool is None:
            raise KeyError(f"unknown deployment {deployment!r}")
        pool.set_replicas(list(endpoints), None if ready is None else list(ready))

    def deployment_stats(self) -> list[DeploymentStats]:
        """Per deployment: queue depth, in-flight, measured service rate, replicas."""
        return [pool.stats() for pool in self.pools.values()]

    def render_metrics(self) -> bytes:
        for pool in self.pools.values():
            self.metrics.set_pool_gauges(pool.stats())
        if isinstance(self.limiter, FailoverLimiter):
            self.metrics.limits_degraded.set(1 if self.limiter.degraded else 0)
        return self.metrics.render()

    # -- ASGI -------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            if headers_too_large(scope):
                await send_header_error(send)
                return
            await self._http_or_error(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http_or_error(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Every error in OpenAI's shape: a refusal as itself, a bug as a logged 500 (never
        the server's plain-text page); a bug after the answer started ends the connection."""
        try:
            await self._http(scope, receive, send)
        except OpenAIError as exc:
            headers = [(k.encode(), v.encode()) for k, v in exc.headers.items()]
            await respond(send, exc.status, exc.body_bytes(), headers=headers)
        except Exception as exc:
            log.exception("internal_error %s %s", scope["method"], scope["path"])
            try:
                await respond(send, 500, INTERNAL_ERROR.body_bytes())
            except Exception:  # the answer had started: a second start is refused
                raise exc from None

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        table = self.table  # one table for the whole request, even across a reconfigure
        if method == "POST" and path in ENDPOINTS:
            await self._completions.handle(table, scope, receive, send, ENDPOINTS[path])
        elif method == "GET" and path == "/v1/models":
            tenant = table.keys.require_tenant(header(scope, b"authorization"))
            await respond(send, 200, table.models_body(tenant))
        elif method == "GET" and path.startswith("/v1/models/"):
            tenant = table.keys.require_tenant(header(scope, b"authorization"))
            model = path.removeprefix("/v1/models/")
            await respond(send, 200, model_card_body(table, tenant, model))
        elif is_batch_path(path):
            if self._batches is None:
                raise OpenAIError(
                    status=404,
                    message="The Batch API is not enabled on this gateway.",
                    code="unknown_url",
                )
            await self._batches.handle(table, scope, receive, send)
        elif method == "GET" and path == "/version":
            await respond(send, 200, json.dumps(version_body()).encode())
        elif method == "GET" and path == "/health":
            await respond(send, 200, b'{"status":"ok"}')
        elif method == "GET" and path == OPENAPI_PATH:
            await respond(send, 200, _OPENAPI)
        elif method == "GET" and path == "/ready":
            if self._ready:
                await respond(send, 200, b'{"status":"ready"}')
            else:
                await respond(send, 503, b'{"status":"starting"}')
        elif path in ENDPOINTS:
            raise method_not_allowed(method, path, "POST")
        elif path in _GET_PATHS or path.startswith("/v1/models/"):
            raise method_not_allowed(method, path, "GET")
        else:
            raise OpenAIError(
                status=404, message=f"Unknown path {method} {path}", code="unknown_url"
            )
