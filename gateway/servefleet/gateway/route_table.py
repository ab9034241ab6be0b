"""Who may reach what: tenants' keys, their routes to pools, limit scopes, spill-over targets.

Everything a request needs is resolved once, when a config is loaded, into an immutable
`RouteTable`; the request path does one dict lookup. Reconfiguring builds a whole new table
(reading every key first, so a bad config raises before anything changes) and the gateway
swaps it in. Pools whose settings did not change are carried over with their queues, replicas
and measurements; the limiter lives across tables, so windows carry over.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from servefleet.api.budgets import TokenPrices
from servefleet.api.gateway_config import (
    GatewayAdapter,
    GatewayConfig,
    GatewayDeployment,
    TenantAccess,
)
from servefleet.api.llmdeployment import TenantLimits
from servefleet.gateway.auth import KeyRing
from servefleet.gateway.budgets import budgets_of
from servefleet.gateway.limits import Limiter, LimitPolicy, LimitScope, LocalLimiter
from servefleet.gateway.limits_failover import FailoverLimiter
from servefleet.gateway.limits_redis import RedisLimiter
from servefleet.gateway.metrics import GatewayMetrics, TenantModelMetrics
from servefleet.gateway.pool import DeploymentPool
from servefleet.gateway.prompt import PromptReader
from servefleet.gateway.queueing import TrafficClass
from servefleet.gateway.spill_budget import RedisSpillBudget

EMPTY_MODEL_LIST = b'{"object":"list","data":[]}'


@dataclass(frozen=True, slots=True)
class SpillTarget:
    """The hosted API a deployment spills over to."""

    base_url: str
    authorization: str  # "Bearer <key>": sent upstream, never logged
    timeout_s: float
    model: str | None  # the hosted API's name for the model


@dataclass(frozen=True, slots=True)
class TenantRoute:
    """What a tenant's request for one model needs, resolved once at load."""

    tenant: str
    pool: DeploymentPool
    reader: PromptReader
    traffic_class: TrafficClass
    weight: float
    scopes: tuple[LimitScope, ...]
    metrics: TenantModelMetrics
    spill: SpillTarget | None
    adapter: GatewayAdapter | None = None  # a LoRA adapter on the pool's base model
    prices: TokenPrices | None = None  # what a cost budget is charged (the deployment's)


@dataclass(frozen=True, slots=True)
class RouteTable:
    config: GatewayConfig
    keys: KeyRing
    pools: Mapping[str, DeploymentPool]  # by deployment name
    routes: Mapping[tuple[str, str], TenantRoute]  # by (tenant, model)
    model_lists: Mapping[str, bytes]  # tenant -> the body of GET /v1/models

    def models_body(self, tenant: str) -> bytes:
        return self.model_lists.get(tenant, EMPTY_MODEL_LIST)


@dataclass(slots=True)
class PoolChanges:
    """The pools of a new config: kept, created (fresh or replacing one) and gone."""

    pools: dict[str, DeploymentPool]
    created: list[DeploymentPool] = field(default_factory=list)
    gone: list[DeploymentPool] = field(default_factory=list)
    kept: list[tuple[DeploymentPool, GatewayDeployment]] = field(default_factory=list)

    def apply(self) -> None:
        """Commit: the kept pools take the new tenants' access (cannot fail)."""
        for pool, deployment in self.kept:
            pool.config = deployment
            pool.tenants = {t.name: t for t in deployment.tenants}


def plan_pools(
    config: GatewayConfig,
    current: Mapping[str, DeploymentPool],
    clock: Callable[[], float],
) -> PoolChanges:
    """A pool whose settings did not change is kept; a changed one is replaced and inherits."""
    changes = PoolChanges(pools={})
    for deployment in config.deployments:
        old = current.get(deployment.name)
        if old is not None and _same_pool(old.config, deployment):
            changes.pools[deployment.name] = old
            changes.kept.append((old, deployment))
            continue
        pool = DeploymentPool(deployment, config.routing, clock=clock)
        if old is not None:
            pool.inherit(old)
        changes.pools[deployment.name] = pool
        changes.created.append(pool)
    changes.gone = [p for name, p in current.items() if changes.pools.get(name) is not p]
    return changes


def _same_pool(old: GatewayDeployment, new: GatewayDeployment) -> bool:
    """True when only the tenants' access, the adapters or the prices changed: the pool can
    stay (prices are read from the route, rebuilt with every table)."""
    keep = {"tenants", "adapters", "token_prices"}
    return old.model_dump(exclude=keep) == new.model_dump(exclude=keep)


def build_route_table(
    config: GatewayConfig,
    pools: Mapping[str, DeploymentPool],
    metrics: GatewayMetrics,
    environ: Mapping[str, str] | None,
) -> RouteTable:
    """Reads every key (files, environment); raises ValueError when one is missing."""
    keys = KeyRing(
        {key.digest(environ): tenant.name for tenant in config.tenants for key in tenant.api_keys}
    )
    limits = {t.name: t.limits for t in config.tenants}
    routes: dict[tuple[str, str], TenantRoute] = {}
    models: dict[str, list[ModelCard]] = {name: [] for name in limits}
    for deployment in config.deployments:
        reader = PromptReader(
            chars_per_token=config.routing.chars_per_token,
            block_size=deployment.block_size,
            affinity_blocks=config.routing.affinity_blocks,
        )
        spill = _spill_target(deployment, environ)
        served: list[tuple[GatewayAdapter | None, list[TenantAccess]]] = [
            (None, deployment.tenants)
        ]
        served += [(a, deployment.adapter_tenants(a)) for a in deployment.adapters]
        for adapter, accesses in served:
            model = deployment.model if adapter is None else adapter.name
            for access in accesses:
                # An adapter shares its base deployment's limits (one pool, one scope).
                scopes = _scopes(
                    access.name, deployment.model, limits[access.name], access.model_limits
                )
                routes[(access.name, model)] = TenantRoute(
                    access.name,
                    pools[deployment.name],
                    reader,
                    TrafficClass.parse(access.traffic_class),
                    access.weight,
                    scopes,
                    metrics.for_tenant(access.name, model),
                    spill if adapter is None else None,  # the hosted API has no fine-tune
                    adapter,
                    deployment.token_prices,
                )
                parent = None if adapter is None else deployment.model
                models[access.name].append(ModelCard(model, parent))
    return RouteTable(config, keys, dict(pools), routes, _model_lists(models))


def _scopes(
    tenant: str, model: str, tenant_limits: TenantLimits, model_limits: TenantLimits | None
) -> tuple[LimitScope, ...]:
    scopes: list[LimitScope] = []
    tenant_policy = _policy(tenant_limits)
    if tenant_policy != LimitPolicy():
        scopes.append(LimitScope(f"t:{tenant}", tenant_policy))
    if model_limits is not None:
        model_policy = _policy(model_limits)
        if model_policy != LimitPolicy():
            scopes.append(LimitScope(f"t:{tenant}:m:{model}", model_policy))
    return tuple(scopes)


def _policy(limits: TenantLimits) -> LimitPolicy:
    return LimitPolicy(
        requests_per_minute=limits.requests_per_minute,
        tokens_per_minute=limits.tokens_per_minute,
        max_concurrent=limits.max_concurrent_requests,
        budgets=budgets_of(limits),
    )


@dataclass(frozen=True, slots=True, order=True)
class ModelCard:
    """A model a tenant may use; an adapter names its base model as `parent` (as vLLM)."""

    id: str
    parent: str | None = None

    def body(self) -> dict[str, object]:
        card: dict[str, object] = {
            "id": self.id, "object": "model", "created": 0, "owned_by": "servefleet"
        }  # fmt: skip
        if self.parent is not None:
            card |= {"parent": self.parent, "root": self.id}
        return card


def _model_lists(models: Mapping[str, list[ModelCard]]) -> dict[str, bytes]:
    return {
        tenant: json.dumps(
            {"object": "list", "data": [card.body() for card in sorted(cards)]}
        ).encode()
        for tenant, cards in models.items()
    }


def _spill_target(
    deployment: GatewayDeployment, environ: Mapping[str, str] | None
) -> SpillTarget | None:
    spill = deployment.spillover
    if spill is None or deployment.spillover_api_key is None:
        return None
    assert spill.base_url is not None
    return SpillTarget(
        spill.base_url.rstrip("/"),
        "Bearer " + deployment.spillover_api_key.read(environ),
        spill.timeout_seconds,
        spill.model,
    )


def make_limiter(
    config: GatewayConfig, metrics: GatewayMetrics, clock: Callable[[], float]
) -> Limiter:
    """Local windows, or Redis with a per-replica share of every limit while it is down."""
    redis = config.redis
    if redis is None:
        return LocalLimiter(clock=clock)

    def on_error(operation: str) -> None:
        metrics.redis_errors.labels(operation).inc()
        metrics.limits_degraded.set(1)

    return FailoverLimiter(
        RedisLimiter(
            redis.url,
            key_prefix=redis.key_prefix,
            timeout_s=redis.timeout_seconds,
            password=redis.password.read() if redis.password is not None else None,
        ),
        LocalLimiter(clock=clock),
        share=1.0 / redis.gateway_replicas,
        on_error=on_error,
    )


def share_spill_budgets(
    pools: Iterable[DeploymentPool],
    config: GatewayConfig,
    limiter: Limiter,
    metrics: GatewayMetrics,
    clock: Callable[[], float],
) -> None:
    """With Redis, every gateway replica takes spill-overs from one bucket per deployment."""
    redis = config.redis
    if redis is None or not isinstance(limiter, FailoverLimiter):
        return

    def on_error(operation: str) -> None:
        metrics.redis_errors.labels(operation).inc()

    for pool in pools:
        spill = pool.config.spillover
        if spill is None:
            continue
        pool.spill_budget = RedisSpillBudget(
            limiter.primary.client,
            f"{redis.key_prefix}:spill:{{{pool.name}}}",
            spill.max_requests_per_minute,
            share=1.0 / redis.gateway_replicas,
            on_error=on_error,
            clock=clock,
        )
