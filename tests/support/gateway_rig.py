"""A real gateway in front of fake replicas, served on a thread: tenant `a` (key `key-a`, a
generous token limit) on deployment `d` of model `m`, every replica ready."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.llmdeployment import TenantLimits
from servefleet.bench.processes import serve_in_thread
from servefleet.gateway.app import Gateway


def served_gateway(
    stack: ExitStack, replica_urls: list[str], **deployment: Any
) -> tuple[Gateway, str]:
    """The gateway and its base URL; `deployment` adds GatewayDeployment fields."""
    config = GatewayConfig(
        tenants=[
            GatewayTenant(
                name="a",
                api_keys=[ApiKeyRef(sha256=hash_api_key("key-a"))],
                limits=TenantLimits(tokens_per_minute=100_000),
            )
        ],
        deployments=[
            GatewayDeployment(name="d", model="m", tenants=[TenantAccess(name="a")], **deployment)
        ],
    )
    gateway = Gateway(config)
    gateway.set_replicas("d", replica_urls, ready=replica_urls)
    return gateway, stack.enter_context(serve_in_thread(gateway))
