"""The internal listener: `/metrics`, deployment stats for the autoscaler, replica lists.

Served on its own port (`internal_port`), never on the tenant port: the metrics name every
tenant and the stats every deployment, and a tenant who can reach the gateway must not read
them. Inside the cluster the port is open to whoever may reach it (Prometheus, the
autoscaler); replacing a deployment's replicas also needs the internal API key when one is
configured, and is refused for deployments that discover their replicas from Kubernetes.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, Field, ValidationError

from servefleet.api.gateway_stats import dump_deployment_stats
from servefleet.gateway.asgi import Receive, Scope, Send, header, read_body, respond
from servefleet.gateway.auth import bearer_matches
from servefleet.gateway.errors import GatewayError, validation_error
from servefleet.gateway.route_table import RouteTable

DEPLOYMENTS_PATH = "/internal/deployments"
METRICS_PATH = "/metrics"
PROMETHEUS_TEXT = b"text/plain; version=0.0.4"


class ReplicaUpdate(BaseModel):
    endpoints: list[str]
    ready: list[str] | None = Field(
        default=None, description="Endpoints known to be ready; others are probed."
    )


def is_replica_update(method: str, path: str) -> bool:
    return (
        method == "POST" and path.startswith(DEPLOYMENTS_PATH + "/") and path.endswith("/replicas")
    )


async def send_deployment_stats(table: RouteTable, send: Send) -> None:
    await respond(send, 200, dump_deployment_stats([p.stats() for p in table.pools.values()]))


async def update_replicas(
    table: RouteTable, internal_key: str | None, scope: Scope, receive: Receive, send: Send
) -> None:
    """Replace a static deployment's replica list; answers with its stats."""
    if internal_key is not None and not bearer_matches(
        header(scope, b"authorization"), internal_key
    ):
        raise GatewayError(401, "This internal endpoint needs the internal API key.")
    path: str = scope["path"]
    name = path[len(DEPLOYMENTS_PATH + "/") : -len("/replicas")]
    pool = table.pools.get(name)
    if pool is None:
        raise GatewayError(404, f"Unknown deployment {name!r}", code="not_found")
    if pool.config.service is not None:
        raise GatewayError(
            409, f"Deployment {name!r} discovers its replicas from Kubernetes", code="conflict"
        )
    raw = await read_body(receive)
    try:
        update = ReplicaUpdate.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    pool.set_replicas(update.endpoints, update.ready)
    await respond(send, 200, pool.stats().model_dump_json().encode())


class InternalApp:
    """The ASGI app of the internal port; it reads the gateway's *current* route table."""

    def __init__(
        self,
        table: Callable[[], RouteTable],
        render_metrics: Callable[[], bytes],
        internal_key: str | None,
    ) -> None:
        self._table = table
        self._render_metrics = render_metrics
        self._internal_key = internal_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan belongs to the tenant app, which owns start and stop
        try:
            await self._http(scope, receive, send)
        except GatewayError as exc:
            await respond(send, exc.status, exc.body())

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method: str = scope["method"]
        path: str = scope["path"]
        if method == "GET" and path == METRICS_PATH:
            await respond(send, 200, self._render_metrics(), content_type=PROMETHEUS_TEXT)
        elif method == "GET" and path == DEPLOYMENTS_PATH:
            await send_deployment_stats(self._table(), send)
        elif is_replica_update(method, path):
            await update_replicas(self._table(), self._internal_key, scope, receive, send)
        elif method == "GET" and path == "/health":
            await respond(send, 200, b'{"status":"ok"}')
        else:
            raise GatewayError(404, f"Unknown path {method} {path}", code="unknown_url")
