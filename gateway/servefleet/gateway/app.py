"""The gateway as an ASGI application: a request's path through auth, limits, admission,
queueing, routing and the proxy.

It is a plain ASGI callable rather than a framework app because every microsecond on this path
is added latency for every token stream; everything that can be resolved once (tenant routes,
limit scopes, metric children, header names) is resolved when the config is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel, Field, ValidationError

from servefleet.api.gateway_config import GatewayConfig, GatewayDeployment
from servefleet.gateway.admission import Action
from servefleet.gateway.auth import KeyRing, bearer_matches
from servefleet.gateway.discovery import EndpointSliceWatcher, KubernetesApi
from servefleet.gateway.errors import GatewayError, error_body, model_not_found, sse_error_event
from servefleet.gateway.limits import (
    FailoverLimiter,
    Limiter,
    LimitPolicy,
    LimitScope,
    LimitSnapshot,
    LocalLimiter,
    RedisLimiter,
    RequestTooLarge,
    Reservation,
)
from servefleet.gateway.metrics import GatewayMetrics, TenantModelMetrics
from servefleet.gateway.pool import DeploymentPool, Lease, Shed, retry_after_header
from servefleet.gateway.prompt import PromptReader
from servefleet.gateway.protocol import ChatCompletionRequest, CompletionRequest
from servefleet.gateway.proxy import (
    SseRelay,
    Usage,
    prepare_body,
    upstream_error_message,
    usage_from_json,
)
from servefleet.gateway.queueing import TrafficClass
from servefleet.gateway.routing import ReplicaState
from servefleet.gateway.spill_budget import RedisSpillBudget
from servefleet.gateway.upstream import (
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)

log = logging.getLogger("servefleet.gateway")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MAX_BODY_BYTES = 16 * 1024 * 1024
JSON = b"application/json"
JSON_HEADERS = [(b"content-type", JSON)]
ROUTE_POOL = b"pool"
ROUTE_SPILL = b"spillover"


class ReplicaUpdate(BaseModel):
    endpoints: list[str]
    ready: list[str] | None = Field(
        default=None, description="Endpoints known to be ready; others are probed."
    )


@dataclass(frozen=True, slots=True)
class TenantRoute:
    """What a tenant's request for one model needs, resolved once at start."""

    tenant: str
    pool: DeploymentPool
    reader: PromptReader
    traffic_class: TrafficClass
    weight: float
    scopes: tuple[LimitScope, ...]
    metrics: TenantModelMetrics


@dataclass(slots=True)
class Call:
    route: TenantRoute
    path: str
    raw: bytes
    parsed: dict[str, Any]
    stream: bool
    wants_usage: bool
    prompt_tokens: int
    tokens: int
    affinity_key: int | None
    started: float
    rl_headers: list[tuple[bytes, bytes]]
    used: Usage | None = None
    events: int = 0
    first_byte: bool = False


def _same_pool(old: GatewayDeployment, new: GatewayDeployment) -> bool:
    """True when only the tenants' access changed: the pool itself can stay."""
    return old.model_dump(exclude={"tenants"}) == new.model_dump(exclude={"tenants"})


def _inherit(pool: DeploymentPool, old: DeploymentPool, now: float) -> None:
    """A replaced pool keeps what was learned: replicas, their readiness, timings, tokenizer."""
    ready = [e for e, r in old.replicas.replicas.items() if r.state is ReplicaState.READY]
    if old.replicas.replicas and pool.config.service == old.config.service:
        pool.set_replicas(list(old.replicas.replicas), ready)
    pool.service_time = old.service_time
    pool.cold_start = old.cold_start
    if pool.config.tokenizer == old.config.tokenizer:
        pool.token_counter = old.token_counter


def _policy(limits: Any) -> LimitPolicy:
    return LimitPolicy(
        requests_per_minute=limits.requests_per_minute,
        tokens_per_minute=limits.tokens_per_minute,
        max_concurrent=limits.max_concurrent_requests,
        daily_tokens=limits.daily_token_budget,
    )


def _unlimited(policy: LimitPolicy) -> bool:
    return policy == LimitPolicy()


def format_reset(seconds: float) -> str:
    """OpenAI's duration style: 20ms, 1.5s, 6m0s."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{int(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    if minutes:
        return f"{int(minutes)}m{int(rest)}s"
    return f"{rest:.3f}".rstrip("0").rstrip(".") + "s"


def ratelimit_headers(snapshot: LimitSnapshot) -> list[tuple[bytes, bytes]]:
    headers: list[tuple[bytes, bytes]] = []
    if snapshot.limit_requests is not None:
        headers += [
            (b"x-ratelimit-limit-requests", str(snapshot.limit_requests).encode()),
            (b"x-ratelimit-remaining-requests", str(snapshot.remaining_requests).encode()),
            (b"x-ratelimit-reset-requests", format_reset(snapshot.reset_requests_s).encode()),
        ]
    if snapshot.limit_tokens is not None:
        headers += [
            (b"x-ratelimit-limit-tokens", str(snapshot.limit_tokens).encode()),
            (b"x-ratelimit-remaining-tokens", str(snapshot.remaining_tokens).encode()),
            (b"x-ratelimit-reset-tokens", format_reset(snapshot.reset_tokens_s).encode()),
        ]
    return headers


def _retry_headers(seconds: float) -> list[tuple[bytes, bytes]]:
    return [
        (b"retry-after", retry_after_header(seconds).encode()),
        (b"retry-after-ms", str(max(1, int(seconds * 1000))).encode()),
    ]


class Gateway:
    """The tenant-facing endpoint of every deployment in a `GatewayConfig`."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        environ: Mapping[str, str] | None = None,
        limiter: Limiter | None = None,
        kubernetes: KubernetesApi | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._clock = clock
        self._environ = environ
        self.metrics = GatewayMetrics()
        self.pools: dict[str, DeploymentPool] = {}  # by deployment name
        self._by_model: dict[str, DeploymentPool] = {}
        for deployment in config.deployments:
            pool = DeploymentPool(deployment, config.routing, clock=clock)
            self.pools[deployment.name] = pool
            self._by_model[deployment.model] = pool
        digests: dict[str, str] = {}
        for tenant in config.tenants:
            for key in tenant.api_keys:
                digests[key.digest(environ)] = tenant.name
        self.keys = KeyRing(digests)
        self._routes: dict[tuple[str, str], TenantRoute] = {}
        self._models_body: dict[str, bytes] = {}
        self._build_routes()
        self.limiter = limiter if limiter is not None else self._make_limiter()
        self._share_spill_budgets(self.pools.values())
        # deployment -> (base URL, authorization header, timeout)
        self._spill_targets: dict[str, tuple[str, str, float]]
        self._spill_targets = self._read_spill_targets(config)
        self._internal_key = (
            config.internal_api_key.read(environ) if config.internal_api_key else None
        )
        self._kubernetes = kubernetes
        self._client: httpx.AsyncClient | None = None  # probes only; requests use _upstream
        self._upstream = UpstreamPool()
        self._tasks: list[asyncio.Task[None]] = []
        self._pool_tasks: dict[str, list[asyncio.Task[None]]] = {}  # by deployment name
        self._started = False
        self._ready = False

    # -- setup ------------------------------------------------------------------------------
    def _build_routes(self) -> None:
        tenants = {t.name: t for t in self.config.tenants}
        models: dict[str, list[str]] = {name: [] for name in tenants}
        for deployment in self.config.deployments:
            pool = self.pools[deployment.name]
            reader = PromptReader(
                chars_per_token=self.config.routing.chars_per_token,
                block_size=deployment.block_size,
                affinity_blocks=self.config.routing.affinity_blocks,
            )
            for access in deployment.tenants:
                tenant_policy = _policy(tenants[access.name].limits)
                scopes: list[LimitScope] = []
                if not _unlimited(tenant_policy):
                    scopes.append(LimitScope(f"t:{access.name}", tenant_policy))
                if access.model_limits is not None:
                    model_policy = _policy(access.model_limits)
                    if not _unlimited(model_policy):
                        scopes.append(
                            LimitScope(f"t:{access.name}:m:{deployment.model}", model_policy)
                        )
                self._routes[(access.name, deployment.model)] = TenantRoute(
                    access.name,
                    pool,
                    reader,
                    TrafficClass.parse(access.traffic_class),
                    access.weight,
                    tuple(scopes),
                    self.metrics.for_tenant(access.name, deployment.model),
                )
                models[access.name].append(deployment.model)
        for tenant, names in models.items():
            self._models_body[tenant] = json.dumps(
                {
                    "object": "list",
                    "data": [
                        {"id": m, "object": "model", "created": 0, "owned_by": "servefleet"}
                        for m in sorted(names)
                    ],
                }
            ).encode()

    def _make_limiter(self) -> Limiter:
        redis = self.config.redis
        if redis is None:
            return LocalLimiter(clock=self._clock)
        degraded = self.metrics.limits_degraded

        def on_error(operation: str) -> None:
            self.metrics.redis_errors.labels(operation).inc()
            degraded.set(1)

        return FailoverLimiter(
            RedisLimiter(redis.url, key_prefix=redis.key_prefix, timeout_s=redis.timeout_seconds),
            LocalLimiter(clock=self._clock),
            share=1.0 / redis.gateway_replicas,
            on_error=on_error,
        )

    def _read_spill_targets(self, config: GatewayConfig) -> dict[str, tuple[str, str, float]]:
        targets: dict[str, tuple[str, str, float]] = {}
        for deployment in config.deployments:
            if deployment.spillover is not None and deployment.spillover_api_key is not None:
                spill = deployment.spillover
                assert spill.base_url is not None
                targets[deployment.name] = (
                    spill.base_url.rstrip("/"),
                    "Bearer " + deployment.spillover_api_key.read(self._environ),
                    spill.timeout_seconds,
                )
        return targets

    def _share_spill_budgets(self, pools: Iterable[DeploymentPool]) -> None:
        """With Redis, every gateway replica takes spill-overs from one bucket per deployment."""
        redis = self.config.redis
        limiter = self.limiter
        if redis is None or not isinstance(limiter, FailoverLimiter):
            return
        for pool in pools:
            spill = pool.config.spillover
            if spill is None:
                continue
            pool.spill_budget = RedisSpillBudget(
                limiter.primary.client,
                f"{redis.key_prefix}:spill:{{{pool.name}}}",
                spill.max_requests_per_minute,
                share=1.0 / redis.gateway_replicas,
                on_error=self._redis_failed,
                clock=self._clock,
            )

    def _redis_failed(self, operation: str) -> None:
        self.metrics.redis_errors.labels(operation).inc()

    async def start(self) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=2.0, trust_env=False)
        self._tasks.append(asyncio.create_task(self._probe_loop(), name="gateway-probes"))
        self._started = True
        for pool in self.pools.values():
            self._start_pool_tasks(pool)
        self._ready = True

    def _start_pool_tasks(self, pool: DeploymentPool) -> None:
        """The tokenizer load and the EndpointSlice watch that feed one pool."""
        tasks = self._pool_tasks.setdefault(pool.name, [])
        if pool.config.tokenizer is not None and pool.token_counter is None:
            tasks.append(
                asyncio.create_task(self._load_tokenizer(pool), name=f"tokens-{pool.name}")
            )
        if pool.config.service is not None:
            tasks.append(asyncio.create_task(self._watch(pool), name=f"watch-{pool.name}"))

    def _cancel_pool_tasks(self, name: str) -> None:
        for task in self._pool_tasks.pop(name, []):
            task.cancel()

    async def stop(self) -> None:
        self._ready = False
        self._started = False
        tasks = [*self._tasks, *(t for ts in self._pool_tasks.values() for t in ts)]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self._pool_tasks.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self._upstream.close()
        await self.limiter.close()

    async def _load_tokenizer(self, pool: DeploymentPool) -> None:
        """Exact prompt counts once the tokenizer is loaded; the estimate until then."""
        source = pool.config.tokenizer
        assert source is not None
        try:
            from servefleet.gateway.token_counter import load_token_counter

            pool.token_counter = await asyncio.to_thread(load_token_counter, source)
        except Exception as exc:  # not available here: the fast estimate stays
            log.warning(
                "deployment %s: tokenizer %s not loaded (%s); prompt tokens are estimated",
                pool.name,
                source,
                exc,
            )
        else:
            log.info("deployment %s: counting prompt tokens with %s", pool.name, source)

    async def _watch(self, pool: DeploymentPool) -> None:
        assert pool.config.service is not None
        api = self._kubernetes or KubernetesApi.in_cluster()
        watcher = EndpointSliceWatcher(api, pool.config.service)
        await watcher.run(lambda endpoints, ready: pool.set_replicas(endpoints, ready))

    # -- hot reconfiguration ----------------------------------------------------------------
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
        digests = {
            key.digest(self._environ): tenant.name
            for tenant in config.tenants
            for key in tenant.api_keys
        }
        spill_targets = self._read_spill_targets(config)
        pools: dict[str, DeploymentPool] = {}
        created: list[DeploymentPool] = []
        for deployment in config.deployments:
            old = self.pools.get(deployment.name)
            if old is not None and _same_pool(old.config, deployment):
                old.config = deployment
                old.tenants = {t.name: t for t in deployment.tenants}
                pools[deployment.name] = old
                continue
            pool = DeploymentPool(deployment, config.routing, clock=self._clock)
            if old is not None:
                _inherit(pool, old, self._clock())
            pools[deployment.name] = pool
            created.append(pool)
        gone = [p for name, p in self.pools.items() if pools.get(name) is not p]
        # Commit: nothing below can fail on bad input.
        self.config = config
        self.pools = pools
        self._by_model = {p.model: p for p in pools.values()}
        self.keys = KeyRing(digests)
        self._spill_targets = spill_targets
        self._routes = {}
        self._models_body = {}
        self._build_routes()
        self._share_spill_budgets(created)
        for pool in gone:
            self._cancel_pool_tasks(pool.name)
            if pool.name not in pools:
                self._forget_metrics(pool)
        if self._started:
            for pool in created:
                self._start_pool_tasks(pool)

    def _forget_metrics(self, pool: DeploymentPool) -> None:
        """A removed deployment's gauges must not be scraped forever at their last value."""
        m = self.metrics
        series = [
            *((m.queue_depth, (pool.model, c)) for c in ("interactive", "batch")),
            (m.in_flight, (pool.model,)),
            (m.replicas_ready, (pool.model,)),
            *((m.replica_outstanding, (pool.model, e)) for e in pool.replicas.replicas),
        ]
        for gauge, labels in series:
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)

    async def _probe_loop(self) -> None:
        interval = self.config.routing.probe_interval_seconds
        while True:
            try:
                await self.probe_once()
            except Exception:  # a probe round must never kill the loop
                log.exception("replica probing failed")
            await asyncio.sleep(interval)

    async def probe_once(self) -> None:
        """Ask every replica's /ready once; starting ones become ready, ready ones draining."""
        client = self._client
        if client is None:
            return
        now = self._clock()
        jobs = []
        for pool in self.pools.values():
            for replica in list(pool.replicas.replicas.values()):
                if replica.ejected_until > now:
                    continue
                jobs.append(self._probe(client, pool, replica))
        if jobs:
            await asyncio.gather(*jobs)

    async def _probe(self, client: httpx.AsyncClient, pool: DeploymentPool, replica: Any) -> None:
        try:
            resp = await client.get(replica.endpoint + "/ready", timeout=2.0)
            ready = resp.status_code == 200
        except httpx.HTTPError:
            ready = False
        pool.probe_result(replica, ready)

    # -- internal API -----------------------------------------------------------------------
    def set_replicas(
        self, deployment: str, endpoints: Iterable[str], ready: Iterable[str] | None = None
    ) -> None:
        """Replace a deployment's replica list (local mode's supervisor calls this)."""
        pool = self.pools.get(deployment)
        if pool is None:
            raise KeyError(f"unknown deployment {deployment!r}")
        pool.set_replicas(list(endpoints), None if ready is None else list(ready))

    def deployment_stats(self) -> list[dict[str, Any]]:
        """Per deployment: queue depth, in-flight, measured service rate, replicas."""
        return [pool.stats() for pool in self.pools.values()]

    # -- ASGI -------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

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
        try:
            if method == "POST" and path == "/v1/chat/completions":
                await self._completion(scope, receive, send, path, chat=True)
            elif method == "POST" and path == "/v1/completions":
                await self._completion(scope, receive, send, path, chat=False)
            elif method == "GET" and path == "/v1/models":
                tenant = self._tenant(scope)
                await _respond(
                    send, 200, self._models_body.get(tenant, b'{"object":"list","data":[]}')
                )
            elif method == "GET" and path == "/health":
                await _respond(send, 200, b'{"status":"ok"}')
            elif method == "GET" and path == "/ready":
                if self._ready:
                    await _respond(send, 200, b'{"status":"ready"}')
                else:
                    await _respond(send, 503, b'{"status":"starting"}')
            elif method == "GET" and path == "/metrics":
                await _respond(
                    send, 200, self._render_metrics(), content_type=b"text/plain; version=0.0.4"
                )
            elif method == "GET" and path == "/internal/deployments":
                await _respond(send, 200, json.dumps(self.deployment_stats()).encode())
            elif (
                method == "POST"
                and path.startswith("/internal/deployments/")
                and path.endswith("/replicas")
            ):
                await self._update_replicas(scope, receive, send, path)
            else:
                raise GatewayError(404, f"Unknown path {method} {path}", code="unknown_url")
        except GatewayError as exc:
            await _respond(
                send,
                exc.status,
                exc.body(),
                headers=[(k.encode(), v.encode()) for k, v in exc.headers.items()],
            )

    def _tenant(self, scope: Scope) -> str:
        tenant = self.keys.tenant_for(_header(scope, b"authorization"))
        if tenant is None:
            raise GatewayError(
                401,
                "Incorrect API key provided.",
                code="invalid_api_key",
                type="invalid_request_error",
            )
        return tenant

    def _render_metrics(self) -> bytes:
        # Gauges are read from the pools at scrape time instead of being kept per request.
        m = self.metrics
        now = self._clock()
        for pool in self.pools.values():
            m.queue_depth.labels(pool.model, "interactive").set(
                pool.queue.depth(TrafficClass.INTERACTIVE)
            )
            m.queue_depth.labels(pool.model, "batch").set(pool.queue.depth(TrafficClass.BATCH))
            m.in_flight.labels(pool.model).set(pool.in_flight)
            m.replicas_ready.labels(pool.model).set(pool.replicas.ready_count(now))
            for replica in pool.replicas.replicas.values():
                m.replica_outstanding.labels(pool.model, replica.endpoint).set(replica.outstanding)
        if isinstance(self.limiter, FailoverLimiter):
            m.limits_degraded.set(1 if self.limiter.degraded else 0)
        return m.render()

    async def _update_replicas(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        if self._internal_key is not None and not bearer_matches(
            _header(scope, b"authorization"), self._internal_key
        ):
            raise GatewayError(401, "This internal endpoint needs the internal API key.")
        name = path[len("/internal/deployments/") : -len("/replicas")]
        pool = self.pools.get(name)
        if pool is None:
            raise GatewayError(404, f"Unknown deployment {name!r}", code="not_found")
        if pool.config.service is not None:
            raise GatewayError(
                409, f"Deployment {name!r} discovers its replicas from Kubernetes", code="conflict"
            )
        raw = await _read_body(receive)
        try:
            update = ReplicaUpdate.model_validate_json(raw)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        pool.set_replicas(update.endpoints, update.ready)
        await _respond(send, 200, json.dumps(pool.stats()).encode())

    # -- the request path ---------------------------------------------------------------------
    async def _completion(
        self, scope: Scope, receive: Receive, send: Send, path: str, *, chat: bool
    ) -> None:
        started = self._clock()
        tenant = self._tenant(scope)
        raw = await _read_body(receive)
        try:
            parsed = json.loads(raw)
        except ValueError:
            raise GatewayError(400, "We could not parse the JSON body of your request.") from None
        if not isinstance(parsed, dict):
            raise GatewayError(400, "The request body must be a JSON object.")
        model = parsed.get("model")
        route = self._routes.get((tenant, model)) if isinstance(model, str) else None
        request: ChatCompletionRequest | CompletionRequest
        try:
            if chat:
                request = ChatCompletionRequest.model_validate(parsed)
            else:
                request = CompletionRequest.model_validate(parsed)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        if route is None:
            raise model_not_found(str(model))
        m = route.metrics
        pool = route.pool
        counter = pool.token_counter
        exact: int | None = None
        if chat:
            assert isinstance(request, ChatCompletionRequest)
            shape = route.reader.chat(parsed["messages"])
            max_tokens = request.max_completion_tokens or request.max_tokens
            if counter is not None:
                exact = counter.chat(parsed["messages"])
        else:
            assert isinstance(request, CompletionRequest)
            shape = route.reader.completion(request.prompt)
            max_tokens = request.max_tokens
            if counter is not None:
                exact = counter.completion(request.prompt)
        prompt_tokens = shape.estimated_tokens if exact is None else exact
        completion = max_tokens or pool.config.default_max_tokens
        tokens = prompt_tokens + completion * request.n
        wants_usage = bool(request.stream_options and request.stream_options.include_usage)

        reservation: Reservation | None = None
        rl_headers: list[tuple[bytes, bytes]] = []
        if route.scopes:
            try:
                decision = await self.limiter.reserve(route.scopes, tokens)
            except RequestTooLarge as exc:
                m.outcome["4xx"].inc()
                raise GatewayError(
                    400,
                    str(exc),
                    code="request_too_large",
                    param="max_tokens",
                    headers={"x-should-retry": "false"},
                ) from None
            rl_headers = ratelimit_headers(decision.snapshot)
            if not decision.admitted:
                m.outcome["429"].inc()
                kind = "requests" if decision.exceeded == "requests_per_minute" else "tokens"
                await _respond(
                    send,
                    429,
                    error_body(
                        f"Rate limit reached for tenant {tenant} on {decision.exceeded}; "
                        f"try again in {decision.retry_after_s:.1f}s.",
                        kind,
                        "rate_limit_exceeded",
                    ),
                    headers=rl_headers + _retry_headers(decision.retry_after_s),
                )
                return
            reservation = decision.reservation
        call = Call(
            route,
            path,
            raw,
            parsed,
            request.stream,
            wants_usage,
            prompt_tokens,
            tokens,
            shape.affinity_key,
            started,
            rl_headers,
        )
        try:
            await self._dispatch(call, send, receive)
        finally:
            if reservation is not None:
                await self.limiter.settle(reservation, self._used_tokens(call, reservation))

    @staticmethod
    def _used_tokens(call: Call, reservation: Reservation) -> int:
        if call.used is not None:
            return call.used.prompt_tokens + call.used.completion_tokens
        if not call.first_byte:
            return 0  # nothing was served: give everything back
        # A stream that broke before its usage chunk: prompt plus one token per event.
        return min(reservation.tokens, call.prompt_tokens + call.events)

    async def _dispatch(self, call: Call, send: Send, receive: Receive) -> None:
        route = call.route
        pool = route.pool
        m = route.metrics
        decision = pool.admit(route.tenant, route.traffic_class, call.tokens, route.weight)
        lease: Lease | None = None
        if decision.action is Action.SERVE:
            lease = pool.dispatch_now(call.affinity_key, call.tokens)
            if lease is not None:
                m.queue_wait.observe(0.0)
                pool.record_queue_wait(0.0)
        if decision.action is Action.QUEUE or (decision.action is Action.SERVE and lease is None):
            try:
                lease, waited = await pool.wait_for_slot(
                    route.tenant,
                    route.traffic_class,
                    call.tokens,
                    route.weight,
                    call.affinity_key,
                    call.tokens,
                )
            except Shed as shed:
                m.outcome["503"].inc()
                await self._shed(send, call, shed.retry_after_s, shed.reason)
                return
            m.queue_wait.observe(waited)
            pool.record_queue_wait(waited)
        if decision.action is Action.SPILL:
            budget = pool.spill_budget
            if budget is not None and await budget.take():
                self.metrics.spillovers.labels(pool.model, decision.reason).inc()
                await self._spill(call, send, receive)
                return
            decision_wait = decision.predicted_wait_s
            if decision_wait > pool.config.admission.max_queue_wait:
                m.outcome["503"].inc()
                await self._shed(send, call, decision_wait, "spill-over rate cap reached")
                return
            await self._dispatch_queued_after_spill_cap(call, send, receive)
            return
        if decision.action is Action.SHED:
            m.outcome["503"].inc()
            await self._shed(send, call, decision.predicted_wait_s, decision.reason)
            return
        assert lease is not None
        await self._serve_pool(call, lease, send, receive)

    async def _dispatch_queued_after_spill_cap(
        self, call: Call, send: Send, receive: Receive
    ) -> None:
        route = call.route
        try:
            lease, waited = await route.pool.wait_for_slot(
                route.tenant,
                route.traffic_class,
                call.tokens,
                route.weight,
                call.affinity_key,
                call.tokens,
            )
        except Shed as shed:
            route.metrics.outcome["503"].inc()
            await self._shed(send, call, shed.retry_after_s, shed.reason)
            return
        route.metrics.queue_wait.observe(waited)
        route.pool.record_queue_wait(waited)
        await self._serve_pool(call, lease, send, receive)

    async def _shed(self, send: Send, call: Call, retry_after_s: float, reason: str) -> None:
        await _respond(
            send,
            503,
            error_body(
                f"The model `{call.route.pool.model}` is overloaded ({reason}); "
                f"retry in {retry_after_s:.1f}s.",
                "server_overloaded",
                "overloaded",
            ),
            headers=call.rl_headers + _retry_headers(retry_after_s),
        )

    async def _serve_pool(self, call: Call, lease: Lease, send: Send, receive: Receive) -> None:
        pool = call.route.pool
        m = call.route.metrics
        body = prepare_body(
            call.raw, call.parsed, stream=call.stream, client_wants_usage=call.wants_usage
        )
        config = pool.config
        retried = False
        while True:
            replica = lease.replica
            failure: GatewayError | None = None
            response: UpstreamResponse | None
            try:
                response = await self._upstream.request(
                    "POST",
                    replica.endpoint + call.path,
                    body,
                    JSON_HEADERS,
                    connect_timeout=config.connect_timeout_seconds,
                    read_timeout=config.upstream_timeout_seconds,
                )
            except UpstreamTimeout:
                failure = GatewayError(
                    504, "The model replica timed out.", type="upstream_error", code="timeout"
                )
                response = None
            except UpstreamError as exc:
                failure = GatewayError(
                    502,
                    f"The model replica could not be reached ({exc}).",
                    type="upstream_error",
                    code="upstream_unreachable",
                )
                response = None
            if response is not None and response.status >= 500:
                response.close()
                if response.status == 503:
                    pool.mark_draining(replica)
                    failure = GatewayError(
                        503,
                        "The model replica is draining.",
                        type="server_overloaded",
                        code="overloaded",
                        headers={"retry-after": retry_after_header(pool.cold_start.value)},
                    )
                else:
                    failure = GatewayError(
                        502,
                        f"The model replica failed with status {response.status}.",
                        type="upstream_error",
                        code="upstream_error",
                    )
                response = None
            if failure is not None:
                if failure.status != 503:
                    pool.eject(replica)
                    self.metrics.ejections.labels(pool.model).inc()
                if not retried:
                    moved = pool.reroute(lease)
                    if moved is not None:
                        retried = True
                        lease = moved
                        self.metrics.upstream_retries.labels(pool.model).inc()
                        continue
                pool.release(lease, ok=False)
                m.outcome["503" if failure.status == 503 else "upstream_error"].inc()
                failure.headers.update({k.decode(): v.decode() for k, v in call.rl_headers})
                raise failure
            assert response is not None
            ok = False
            try:
                ok = await self._relay(call, response, send, receive, ROUTE_POOL, spill=False)
            finally:
                pool.release(lease, ok=ok)
            return

    async def _spill(self, call: Call, send: Send, receive: Receive) -> None:
        pool = call.route.pool
        base, auth, timeout_s = self._spill_targets[pool.name]
        spill = pool.config.spillover
        assert spill is not None
        body = prepare_body(
            call.raw,
            call.parsed,
            stream=call.stream,
            client_wants_usage=call.wants_usage,
            model=spill.model,
        )
        url = base + call.path.removeprefix("/v1")
        m = call.route.metrics
        rl = {k.decode(): v.decode() for k, v in call.rl_headers}
        try:
            response = await self._upstream.request(
                "POST",
                url,
                body,
                [(b"content-type", JSON), (b"authorization", auth.encode())],
                connect_timeout=min(timeout_s, 10.0),
                read_timeout=timeout_s,
            )
        except UpstreamTimeout:
            m.outcome["upstream_error"].inc()
            raise GatewayError(
                504,
                "The spill-over API timed out.",
                type="upstream_error",
                code="timeout",
                headers=rl,
            ) from None
        except UpstreamError as exc:
            m.outcome["upstream_error"].inc()
            raise GatewayError(
                502,
                f"The spill-over API could not be reached ({exc}).",
                type="upstream_error",
                code="upstream_unreachable",
                headers=rl,
            ) from None
        await self._relay(call, response, send, receive, ROUTE_SPILL, spill=True)

    async def _relay(
        self,
        call: Call,
        response: UpstreamResponse,
        send: Send,
        receive: Receive,
        route_header: bytes,
        *,
        spill: bool,
    ) -> bool:
        """Send the upstream response to the client; True when it completed."""
        m = call.route.metrics
        status = response.status
        headers = [
            (b"content-type", response.header(b"content-type") or JSON),
            (b"x-servefleet-route", route_header),
            *call.rl_headers,
        ]
        if status != 200 or not call.stream:
            try:
                body = await response.read()
            except UpstreamError as exc:
                response.close()
                m.outcome["upstream_error"].inc()
                code = 504 if isinstance(exc, UpstreamTimeout) else 502
                await _respond(
                    send,
                    code,
                    error_body("The upstream failed while answering.", "upstream_error", "timeout"),
                    headers=headers[1:],
                )
                return False
            response.close()
            if status >= 400:
                if spill and status not in (400, 404, 422):
                    # Our key, their quota, their outage: not the tenant's error to see as-is.
                    m.outcome["upstream_error"].inc()
                    await _respond(
                        send,
                        502,
                        error_body(
                            "The spill-over API failed: " + upstream_error_message(status, body),
                            "upstream_error",
                            "upstream_error",
                        ),
                        headers=headers[1:],
                    )
                    return False
                if b'"error"' not in body:
                    body = error_body(upstream_error_message(status, body), "upstream_error")
                    headers[0] = (b"content-type", JSON)
                m.outcome["4xx" if status < 500 else "upstream_error"].inc()
                await _respond(send, status, body, headers=headers[1:], content_type=headers[0][1])
                return status < 500
            call.used = usage_from_json(body)
            call.first_byte = True
            self._observe_ttft(call, spill)
            await _respond(send, 200, body, headers=headers[1:], content_type=headers[0][1])
            self._count_ok(call, spill)
            return True
        # Streaming 200.
        headers.append((b"cache-control", b"no-cache"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        relay = SseRelay(strip_usage=not call.wants_usage)
        gone = asyncio.ensure_future(receive())
        completed = False
        try:
            async for chunk in response.iter_chunks():
                out = relay.feed(chunk)
                if out:
                    if not call.first_byte:
                        call.first_byte = True
                        self._observe_ttft(call, spill)
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if gone.done():
                    break  # the client left: closing the upstream aborts the generation
            else:
                completed = relay.done
        except UpstreamError as exc:
            what = "timed out" if isinstance(exc, UpstreamTimeout) else "failed"
            await send(
                {
                    "type": "http.response.body",
                    "body": relay.flush()
                    + sse_error_event(f"The upstream {what} mid-stream.", "upstream_error"),
                    "more_body": True,
                }
            )
        finally:
            gone.cancel()
            response.close()
        await send({"type": "http.response.body", "body": relay.flush(), "more_body": False})
        call.used = relay.usage
        call.events = relay.events
        if completed:
            self._count_ok(call, spill)
        else:
            m.outcome["upstream_error"].inc()
        return completed

    def _observe_ttft(self, call: Call, spill: bool) -> None:
        ttft = self._clock() - call.started
        call.route.metrics.ttft.observe(ttft)
        if not spill:  # the pool's own TTFT is what its autoscaler acts on
            call.route.pool.record_ttft(ttft)

    @staticmethod
    def _count_ok(call: Call, spill: bool) -> None:
        m = call.route.metrics
        m.outcome["spilled" if spill else "ok"].inc()
        if call.used is not None:
            m.prompt_tokens.inc(call.used.prompt_tokens)
            m.completion_tokens.inc(call.used.completion_tokens)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def _read_body(receive: Receive) -> bytes:
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):
        return body
    parts = [body]
    size = len(body)
    while message.get("more_body"):
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise GatewayError(413, "The request body is too large.")
        parts.append(chunk)
    return b"".join(parts)


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    *,
    headers: list[tuple[bytes, bytes]] | None = None,
    content_type: bytes = JSON,
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *(headers or ()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _validation_error(exc: ValidationError) -> GatewayError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    message = "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
    )
    return GatewayError(400, f"Invalid request: {message}", param=param)
