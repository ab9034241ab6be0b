"""The internal listener: `/metrics`, deployment stats for the autoscaler, replica lists, and
the usage report (`/internal/usage`, `usage_api`).

Served on its own port (`internal_port`), never on the tenant port: the metrics name every
tenant, the stats every deployment, and a replica list decides where prompts and the engine
key are sent. So every path but `/health` needs `Authorization: Bearer <internal_api_key>`
(compared as bytes, in constant time); without a configured key the app answers nothing else.
A replica update must name `http(s)://host:port` endpoints inside the deployment's allowed
networks, and is refused for deployments that discover their replicas from Kubernetes.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, Field, ValidationError

from servefleet.api.gateway_config import GatewayDeployment
from servefleet.api.gateway_stats import dump_deployment_stats
from servefleet.api.openai_errors import OpenAIError
from servefleet.api.replica_endpoints import ReplicaTargets
from servefleet.api.usage_query import QueryFn
from servefleet.gateway.asgi import Receive, Scope, Send, header, read_body, respond
from servefleet.gateway.auth import bearer_matches
from servefleet.gateway.errors import method_not_allowed, validation_error
from servefleet.gateway.route_table import RouteTable
from servefleet.gateway.usage_api import USAGE_PATH, send_usage

DEPLOYMENTS_PATH = "/internal/deployments"
METRICS_PATH = "/metrics"
HEALTH_PATH = "/health"
PROMETHEUS_TEXT = b"text/plain; version=0.0.4"
MAX_ENDPOINTS = 1024


class ReplicaUpdate(BaseModel):
    endpoints: list[str] = Field(max_length=MAX_ENDPOINTS)
    ready: list[str] | None = Field(
        default=None,
        max_length=MAX_ENDPOINTS,
        description="Endpoints known to be ready; others are probed.",
    )


def is_replicas_path(path: str) -> bool:
    return path.startswith(DEPLOYMENTS_PATH + "/") and path.endswith("/replicas")


def allowed_methods(path: str) -> str | None:
    """The methods a known internal path takes (the `Allow` header), None for unknown paths."""
    if path in (METRICS_PATH, DEPLOYMENTS_PATH, HEALTH_PATH, USAGE_PATH):
        return "GET"
    if is_replicas_path(path):
        return "POST"
    return None


def require_internal_key(scope: Scope, internal_key: str | None) -> None:
    if internal_key is None:
        raise OpenAIError(
            status=401,
            message="No internal API key is configured; this port serves only /health.",
            code="invalid_api_key",
        )
    if not bearer_matches(header(scope, b"authorization"), internal_key):
        raise OpenAIError(
            status=401,
            message="This internal endpoint needs the internal API key.",
            code="invalid_api_key",
        )


def check_endpoint(deployment: GatewayDeployment, endpoint: str, param: str) -> None:
    """400 unless `endpoint` is a plain http(s) address the platform allowed for it."""
    targets = ReplicaTargets.of(deployment.endpoints, deployment.allowed_replica_networks)
    problem = targets.problem(endpoint)
    if problem is not None:
        raise OpenAIError(status=400, message=f"Endpoint {endpoint!r} {problem}.", param=param)


async def send_deployment_stats(table: RouteTable, send: Send) -> None:
    await respond(send, 200, dump_deployment_stats([p.stats() for p in table.pools.values()]))


async def update_replicas(table: RouteTable, scope: Scope, receive: Receive, send: Send) -> None:
    """Replace a static deployment's replica list; answers with its stats."""
    path: str = scope["path"]
    name = path[len(DEPLOYMENTS_PATH + "/") : -len("/replicas")]
    pool = table.pools.get(name)
    if pool is None:
        raise OpenAIError(status=404, message=f"Unknown deployment {name!r}", code="not_found")
    if pool.config.service is not None:
        raise OpenAIError(
            status=409,
            message=f"Deployment {name!r} discovers its replicas from Kubernetes",
            code="conflict",
        )
    raw = await read_body(receive)
    try:
        update = ReplicaUpdate.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    for i, endpoint in enumerate(update.endpoints):
        check_endpoint(pool.config, endpoint, f"endpoints.{i}")
    pool.set_replicas(update.endpoints, update.ready)
    await respond(send, 200, pool.stats().model_dump_json().encode())


class InternalApp:
    """The ASGI app of the internal port; it reads the gateway's *current* route table."""

    def __init__(
        self,
        table: Callable[[], RouteTable],
        render_metrics: Callable[[], bytes],
        internal_key: str | None,
        usage_query: QueryFn | None = None,
    ) -> None:
        self._table = table
        self._render_metrics = render_metrics
        self._internal_key = internal_key
        self._usage_query = usage_query  # Prometheus, for /internal/usage (`usage_api`)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan belongs to the tenant app, which owns start and stop
        try:
            await self._http(scope, receive, send)
        except OpenAIError as exc:
            headers = [(k.encode(), v.encode()) for k, v in exc.headers.items()]
            await respond(send, exc.status, exc.body_bytes(), headers=headers)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method: str = scope["method"]
        path: str = scope["path"]
        if method == "GET" and path == HEALTH_PATH:
            await respond(send, 200, b'{"status":"ok"}')
            return
        require_internal_key(scope, self._internal_key)  # before anything says what exists
        allowed = allowed_methods(path)
        if allowed is None:
            raise OpenAIError(
                status=404, message=f"Unknown path {method} {path}", code="unknown_url"
            )
        if method not in allowed.split(", "):
            raise method_not_allowed(method, path, allowed)
        if path == METRICS_PATH:
            await respond(send, 200, self._render_metrics(), content_type=PROMETHEUS_TEXT)
        elif path == DEPLOYMENTS_PATH:
            await send_deployment_stats(self._table(), send)
        elif path == USAGE_PATH:
            configs = {name: pool.config for name, pool in self._table().pools.items()}
            await send_usage(configs, scope, send, self._usage_query)
        else:
            await update_replicas(self._table(), scope, receive, send)
