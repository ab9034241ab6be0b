"""The internal endpoints: deployment stats for the autoscaler, replica lists for static pools.

`GET /internal/deployments` is open like `/metrics` (it holds no secret); replacing a
deployment's replicas needs the internal API key when one is configured, and is refused for
deployments that discover their replicas from Kubernetes.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, ValidationError

from servefleet.api.gateway_stats import dump_deployment_stats
from servefleet.gateway.asgi import Receive, Scope, Send, header, read_body, respond
from servefleet.gateway.auth import bearer_matches
from servefleet.gateway.errors import GatewayError, validation_error
from servefleet.gateway.route_table import RouteTable

DEPLOYMENTS_PATH = "/internal/deployments"


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
