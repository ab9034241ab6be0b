"""Route ConfigMaps → one GatewayConfig: parse, resolve Secret references, merge. Pure.

The operator writes one route per LLMDeployment (`<name>-gateway-route`, `gateway.yaml`: a
GatewayConfig fragment whose keys are files `<mount>/<namespace>/<secret>/<key>`). Here those
references become SHA-256 digests (tenant keys) or in-memory values (spill-over keys), read
through the API server instead of mounted files, because the Secrets live in the tenants'
namespaces and a pod can only mount its own.

Trust: a route is written by whoever may write ConfigMaps in its namespace, so it may only
reference Secrets of that same namespace (the gateway can read Secrets everywhere), never
files or environment variables of the gateway; and a tenant belongs to the first namespace
that names it (ordered by namespace, then name), so another namespace cannot add a key to
someone else's tenant. A route that breaks a rule is rejected whole, with a reason; the rest
are served.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import SecretStr, ValidationError

from servefleet.api.conventions import ROUTE_GATEWAY_KEY, SECRETS_MOUNT
from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    SecretValueRef,
)


@dataclass(frozen=True, order=True, slots=True)
class SecretKeyPath:
    """One key of one Secret: what a route's file reference stands for."""

    namespace: str
    name: str
    key: str

    def __str__(self) -> str:  # names only: never a value
        return f"{self.namespace}/{self.name}[{self.key}]"


@dataclass(frozen=True, slots=True)
class Route:
    """One route ConfigMap, parsed; keys are still references."""

    namespace: str
    name: str
    config: GatewayConfig

    @property
    def id(self) -> str:
        return f"{self.namespace}/{self.name}"


class RouteError(ValueError):
    """A route that cannot be served; the message says why (and never holds a key)."""


def parse_route(configmap: Mapping[str, Any]) -> Route:
    meta = configmap.get("metadata") or {}
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    text = (configmap.get("data") or {}).get(ROUTE_GATEWAY_KEY)
    if text is None:
        raise RouteError(f"{namespace}/{name}: no {ROUTE_GATEWAY_KEY}")
    try:
        config = GatewayConfig.model_validate(yaml.safe_load(text) or {})
    except (yaml.YAMLError, ValidationError) as exc:
        raise RouteError(f"{namespace}/{name}: invalid {ROUTE_GATEWAY_KEY}: {exc}") from None
    return Route(namespace, name, config)


def secret_path(ref: SecretValueRef, namespace: str, mount: str = SECRETS_MOUNT) -> SecretKeyPath:
    """The Secret a reference names; only `<mount>/<namespace>/<secret>/<key>` is allowed."""
    if ref.file is None:
        raise RouteError("keys in routes must be Secret references, not env vars or values")
    prefix = mount.rstrip("/") + "/"
    parts = ref.file[len(prefix) :].split("/") if ref.file.startswith(prefix) else []
    if len(parts) != 3 or not all(parts) or ".." in parts:
        raise RouteError(f"key file {ref.file!r} is not a Secret reference under {mount}")
    if parts[0] != namespace:
        raise RouteError(f"a route in {namespace} may not use Secrets of namespace {parts[0]}")
    return SecretKeyPath(*parts)


def referenced_secrets(
    route: Route, mount: str = SECRETS_MOUNT
) -> tuple[set[SecretKeyPath], set[SecretKeyPath]]:
    """(tenant key references, value references) of a route; raises RouteError.

    Values (spill-over and engine keys) are kept as they are: they are sent upstream."""
    tenant_refs: set[SecretKeyPath] = set()
    for tenant in route.config.tenants:
        for key in tenant.api_keys:
            if key.source is not None:
                tenant_refs.add(secret_path(key.source, route.namespace, mount))
    spill_refs = {
        secret_path(ref, route.namespace, mount)
        for d in route.config.deployments
        for ref in (d.spillover_api_key, d.engine_api_key)
        if ref is not None
    }
    return tenant_refs, spill_refs


@dataclass(slots=True)
class ResolvedSecrets:
    """What the gateway holds of Secrets: digests of tenant keys, values of spill-over keys."""

    digests: dict[SecretKeyPath, str] = field(default_factory=dict)
    values: dict[SecretKeyPath, SecretStr] = field(default_factory=dict)


def resolve_route(
    route: Route, secrets: ResolvedSecrets, mount: str = SECRETS_MOUNT
) -> tuple[GatewayConfig, list[str]]:
    """The route with every reference replaced, and warnings for the ones not available.

    A tenant none of whose keys is available is left out (its requests get 401 until the
    Secret exists); a deployment whose spill-over key is missing runs without spill-over.
    """
    warnings: list[str] = []
    tenants: list[GatewayTenant] = []
    for tenant in route.config.tenants:
        keys: list[ApiKeyRef] = []
        for key in tenant.api_keys:
            if key.source is None:
                keys.append(key)
                continue
            path = secret_path(key.source, route.namespace, mount)
            digest = secrets.digests.get(path)
            if digest is None:
                warnings.append(f"{route.id}: tenant {tenant.name}: Secret key {path} not found")
            elif ApiKeyRef(sha256=digest) not in keys:
                keys.append(ApiKeyRef(sha256=digest))
        if keys:
            tenants.append(tenant.model_copy(update={"api_keys": keys}))
    served = {t.name for t in tenants}
    deployments: list[GatewayDeployment] = []
    for deployment in route.config.deployments:
        update: dict[str, Any] = {"tenants": [a for a in deployment.tenants if a.name in served]}
        if deployment.spillover_api_key is not None:
            path = secret_path(deployment.spillover_api_key, route.namespace, mount)
            value = secrets.values.get(path)
            if value is None:
                warnings.append(f"{route.id}: spill-over key {path} not found; spill-over off")
                update |= {"spillover": None, "spillover_api_key": None}
            else:
                update["spillover_api_key"] = SecretValueRef(value=value)
        if deployment.engine_api_key is not None:
            path = secret_path(deployment.engine_api_key, route.namespace, mount)
            value = secrets.values.get(path)
            if value is None:  # engines would answer 401: serve nothing until the key is there
                warnings.append(f"{route.id}: engine key {path} not found; not served yet")
                continue
            update["engine_api_key"] = SecretValueRef(value=value)
        deployments.append(deployment.model_copy(update=update))
    resolved = route.config.model_copy(update={"tenants": tenants, "deployments": deployments})
    return resolved, warnings


@dataclass(slots=True)
class MergeResult:
    config: GatewayConfig
    served: list[str]  # route ids
    rejected: dict[str, str]  # route id -> reason


def merge_routes(base: GatewayConfig, routes: Iterable[tuple[Route, GatewayConfig]]) -> MergeResult:
    """The base config plus every resolved route that fits, in (namespace, name) order.

    A route is rejected whole when it names a deployment or model already served, claims a
    tenant of another namespace (or of the base config), or gives a tenant of its namespace
    different tenant-wide limits than an earlier route did.
    """
    owner: dict[str, str | None] = {t.name: None for t in base.tenants}
    tenants: dict[str, GatewayTenant] = {t.name: t for t in base.tenants}
    deployments: list[GatewayDeployment] = list(base.deployments)
    served: list[str] = []
    rejected: dict[str, str] = {}
    for route, config in sorted(routes, key=lambda pair: (pair[0].namespace, pair[0].name)):
        try:
            merged_tenants = _merge_tenants(tenants, owner, route.namespace, config.tenants)
            names = {d.name for d in deployments}
            models = {d.model for d in deployments}
            for deployment in config.deployments:
                if deployment.name in names:
                    raise RouteError(f"deployment {deployment.name} is already served")
                if deployment.model in models:
                    raise RouteError(f"model {deployment.model} is already served")
            candidate = base.model_copy(
                update={
                    "tenants": list(merged_tenants.values()),
                    "deployments": [*deployments, *config.deployments],
                }
            )
            GatewayConfig.model_validate(candidate.model_dump())  # cross-reference checks
        except (RouteError, ValidationError) as exc:
            rejected[route.id] = str(exc)
            continue
        for tenant in config.tenants:
            owner.setdefault(tenant.name, route.namespace)
        tenants = merged_tenants
        deployments = list(candidate.deployments)
        served.append(route.id)
    config = base.model_copy(update={"tenants": list(tenants.values()), "deployments": deployments})
    return MergeResult(config, served, rejected)


def _merge_tenants(
    tenants: Mapping[str, GatewayTenant],
    owner: Mapping[str, str | None],
    namespace: str,
    new: Iterable[GatewayTenant],
) -> dict[str, GatewayTenant]:
    merged = dict(tenants)
    for tenant in new:
        known = merged.get(tenant.name)
        if known is None:
            merged[tenant.name] = tenant
            continue
        holder = owner.get(tenant.name)
        if holder != namespace:
            where = "the gateway's base config" if holder is None else f"namespace {holder}"
            raise RouteError(f"tenant {tenant.name} belongs to {where}")
        if known.limits != tenant.limits:
            raise RouteError(
                f"tenant {tenant.name}: tenant-wide limits differ from another route in {namespace}"
            )
        keys = [*known.api_keys, *(k for k in tenant.api_keys if k not in known.api_keys)]
        merged[tenant.name] = known.model_copy(update={"api_keys": keys})
    return merged
