"""Route ConfigMaps → one GatewayConfig: parse, resolve Secret references, merge. Pure.

The operator writes one route per LLMDeployment (`<name>-gateway-route`, `gateway.yaml`: a
GatewayConfig fragment whose keys are files `<mount>/<namespace>/<secret>/<key>`). Here those
references become SHA-256 digests (tenant keys) or in-memory values (spill-over keys), read
through the API server instead of mounted files, because the Secrets live in the tenants'
namespaces and a pod can only mount its own.

Trust: whoever may write ConfigMaps in a namespace can write something that looks like a
route, so a route is served only when
- the operator signed it (`servefleet.api.route_signature`: HMAC over its namespace, name,
  owner and data with the key the chart shares between operator and gateway) and an
  LLMDeployment of its namespace owns it (controller ownerReference, part of the signature);
- its replicas come only from service discovery of a Service in its own namespace (no
  static endpoints), its tokenizer is a built-in name (never a file of the gateway's), and it
  references only Secrets of its own namespace (never the gateway's files or environment).
Its tenants and deployments are visible only within its namespace: they are renamed
`<namespace>/<name>` (`conventions.route_scoped`; so are the metrics and stats series, and
the tenants an adapter of the route lists), a
tenant reaches only its own namespace's deployments, so no other namespace can squat a
tenant, deployment or model name. A route that breaks a rule is rejected whole, with a
reason; the rest are served. A spill-over target that is not a public address (unless the
admin allows it, `spill_guard`) turns that deployment's spill-over off, with a warning.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import SecretStr, ValidationError

from servefleet.api.builtin_models import BUILTIN_MODELS
from servefleet.api.conventions import (
    ANNOTATION_ROUTE_SIGNATURE,
    ROUTE_GATEWAY_KEY,
    SECRETS_MOUNT,
    route_scoped,
)
from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    SecretValueRef,
)
from servefleet.api.llmdeployment import API_GROUP, KIND
from servefleet.api.route_signature import signature_matches


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


def _owner_uid(meta: Mapping[str, Any]) -> str | None:
    """The uid of the LLMDeployment that controls the object, or None."""
    owners = [
        ref
        for ref in meta.get("ownerReferences") or []
        if isinstance(ref, Mapping)
        and ref.get("controller") is True
        and ref.get("kind") == KIND
        and str(ref.get("apiVersion", "")).startswith(f"{API_GROUP}/")
        and ref.get("uid")
    ]
    return str(owners[0]["uid"]) if len(owners) == 1 else None


def _check_signed(meta: Mapping[str, Any], data: Mapping[str, Any], key: bytes) -> None:
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    owner = _owner_uid(meta)
    if owner is None:
        raise RouteError(f"{namespace}/{name}: not owned by an LLMDeployment of its namespace")
    signature = (meta.get("annotations") or {}).get(ANNOTATION_ROUTE_SIGNATURE)
    if not isinstance(signature, str):
        raise RouteError(f"{namespace}/{name}: unsigned (not rendered by the operator)")
    text = {str(k): str(v) for k, v in data.items()}
    if not signature_matches(key, signature, namespace, name, owner, text):
        raise RouteError(
            f"{namespace}/{name}: bad signature (not rendered by the operator, or changed since)"
        )


def _check_sources(route: Route) -> None:
    """Replicas only from a Service of the route's namespace; tokenizers only built-in."""
    for deployment in route.config.deployments:
        where = f"{route.id}: deployment {deployment.name}"
        if deployment.endpoints:
            raise RouteError(f"{where}: static endpoints are not allowed in routes")
        service = deployment.service
        if service is None or service.namespace != route.namespace:
            raise RouteError(f"{where}: replicas must come from a Service of {route.namespace}")
        if deployment.tokenizer is not None and deployment.tokenizer not in BUILTIN_MODELS:
            raise RouteError(f"{where}: tokenizer must be a built-in model name")


def parse_route(configmap: Mapping[str, Any], signing_key: bytes) -> Route:
    """A route the operator rendered, checked (signature, owner, sources); else RouteError."""
    meta = configmap.get("metadata") or {}
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    data = configmap.get("data") or {}
    _check_signed(meta, data, signing_key)
    text = data.get(ROUTE_GATEWAY_KEY)
    if text is None:
        raise RouteError(f"{namespace}/{name}: no {ROUTE_GATEWAY_KEY}")
    try:
        config = GatewayConfig.model_validate(yaml.safe_load(text) or {})
    except (yaml.YAMLError, ValidationError) as exc:
        raise RouteError(f"{namespace}/{name}: invalid {ROUTE_GATEWAY_KEY}: {exc}") from None
    route = Route(namespace, name, config)
    _check_sources(route)
    return route


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
    route: Route,
    secrets: ResolvedSecrets,
    mount: str = SECRETS_MOUNT,
    spill_problems: Mapping[str, str] | None = None,
) -> tuple[GatewayConfig, list[str]]:
    """The route with every reference replaced, and warnings for the ones not available.

    A tenant none of whose keys is available is left out (its requests get 401 until the
    Secret exists); a deployment whose spill-over key is missing runs without spill-over, and
    so does one whose target `spill_problems` refuses (base URL -> why, from `spill_guard`;
    the caller logs those, once).
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
        update: dict[str, Any] = {
            "tenants": [a for a in deployment.tenants if a.name in served],
            # An adapter keeps only tenants still served ([] stays "nobody", never "all").
            "adapters": [
                a.model_copy(update={"tenants": [t for t in a.tenants if t in served]})
                if a.tenants is not None
                else a
                for a in deployment.adapters
            ],
        }
        spill_url = deployment.spillover.base_url if deployment.spillover else None
        refused = (spill_problems or {}).get(spill_url or "")
        if refused is not None:
            update |= {"spillover": None, "spillover_api_key": None}
        elif deployment.spillover_api_key is not None:
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


def scope_route(route: Route, config: GatewayConfig) -> GatewayConfig:
    """The route's tenants and deployments renamed `<namespace>/<name>`: a tenant of a
    route reaches only deployments of its namespace, and names never meet across them."""

    def scoped(name: str) -> str:
        return route_scoped(route.namespace, name)

    tenants = [t.model_copy(update={"name": scoped(t.name)}) for t in config.tenants]
    deployments = [
        d.model_copy(
            update={
                "name": scoped(d.name),
                "tenants": [a.model_copy(update={"name": scoped(a.name)}) for a in d.tenants],
                "adapters": [
                    a.model_copy(update={"tenants": [scoped(t) for t in a.tenants]})
                    if a.tenants is not None
                    else a
                    for a in d.adapters
                ],
            }
        )
        for d in config.deployments
    ]
    return config.model_copy(update={"tenants": tenants, "deployments": deployments})


def merge_routes(base: GatewayConfig, routes: Iterable[tuple[Route, GatewayConfig]]) -> MergeResult:
    """The base config plus every resolved route that fits, in (namespace, name) order.

    A route is rejected whole when it names a deployment already served, takes a name of the
    base config, gives a tenant different tenant-wide limits than an earlier route of its
    namespace did, or would serve one of its tenants a model name twice.
    """
    reserved = {t.name for t in base.tenants}
    tenants: dict[str, GatewayTenant] = {t.name: t for t in base.tenants}
    deployments: list[GatewayDeployment] = list(base.deployments)
    served: list[str] = []
    rejected: dict[str, str] = {}
    for route, config in sorted(routes, key=lambda pair: (pair[0].namespace, pair[0].name)):
        try:
            scoped = scope_route(route, config)
            merged_tenants = _merge_tenants(tenants, reserved, route.namespace, scoped.tenants)
            names = {d.name for d in deployments}
            for deployment in scoped.deployments:
                if deployment.name in names:
                    raise RouteError(f"deployment {deployment.name} is already served")
            candidate = base.model_copy(
                update={
                    "tenants": list(merged_tenants.values()),
                    "deployments": [*deployments, *scoped.deployments],
                }
            )
            GatewayConfig.model_validate(candidate.model_dump())  # cross-reference checks
        except (RouteError, ValidationError) as exc:
            rejected[route.id] = str(exc)
            continue
        tenants = merged_tenants
        deployments = list(candidate.deployments)
        served.append(route.id)
    config = base.model_copy(update={"tenants": list(tenants.values()), "deployments": deployments})
    return MergeResult(config, served, rejected)


def _merge_tenants(
    tenants: Mapping[str, GatewayTenant],
    reserved: set[str],
    namespace: str,
    new: Iterable[GatewayTenant],
) -> dict[str, GatewayTenant]:
    """Scoped tenants of one route added; one of an earlier route of the same namespace gets
    this route's keys too (same limits required)."""
    merged = dict(tenants)
    for tenant in new:
        known = merged.get(tenant.name)
        if known is None:
            merged[tenant.name] = tenant
            continue
        if tenant.name in reserved:
            raise RouteError(f"tenant {tenant.name} belongs to the gateway's base config")
        if known.limits != tenant.limits:
            raise RouteError(
                f"tenant {tenant.name}: tenant-wide limits differ from another route in {namespace}"
            )
        keys = [*known.api_keys, *(k for k in tenant.api_keys if k not in known.api_keys)]
        merged[tenant.name] = known.model_copy(update={"api_keys": keys})
    return merged
