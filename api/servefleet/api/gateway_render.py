"""LLMDeployments (and the LLMAdapters served on them) → the gateway's configuration, for
both modes.

The operator renders it into each route ConfigMap (keys stay in Secrets, referenced as
mounted files) and `servefleet up` renders it in process (keys resolved now, tenant keys kept
as hashes only); both call `render_gateway_config`, so the two modes cannot drift.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from pydantic import SecretStr

from servefleet.api.disaggregation_flags import SGLANG_BOOTSTRAP_PORT
from servefleet.api.engines import engine_adapter
from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayAdapter,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    PrefillRouting,
    RedisConfig,
    SecretValueRef,
    ServiceRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.llmadapter import LLMAdapter
from servefleet.api.llmdeployment import LLMDeployment, PoolSpec, SecretKeyRef, TenantSpec
from servefleet.api.local_volumes import local_pvc_folder
from servefleet.api.lora_source import kube_lora_path


class KeySource(Protocol):
    """Turns Secret references into what the gateway config may hold."""

    def tenant_key(self, ref: SecretKeyRef) -> ApiKeyRef: ...

    def secret_value(self, ref: SecretKeyRef) -> SecretValueRef: ...


class MountedSecretKeys:
    """Kubernetes: Secrets are mounted at `<mount_dir>/<secret name>/<key>` in the gateway pod."""

    def __init__(self, mount_dir: str) -> None:
        self.mount_dir = mount_dir.rstrip("/")

    def path(self, ref: SecretKeyRef) -> str:
        return f"{self.mount_dir}/{ref.name}/{ref.key}"

    def tenant_key(self, ref: SecretKeyRef) -> ApiKeyRef:
        return ApiKeyRef(source=SecretValueRef(file=self.path(ref)))

    def secret_value(self, ref: SecretKeyRef) -> SecretValueRef:
        return SecretValueRef(file=self.path(ref))


class ResolvedSecretKeys:
    """Local mode: secret values resolved now (env or file); tenant keys kept as hashes only."""

    def __init__(self, resolve: Callable[[SecretKeyRef], str | None]) -> None:
        self._resolve = resolve

    def _value(self, ref: SecretKeyRef) -> str:
        value = self._resolve(ref)
        if value is None:
            raise ValueError(f"secret {ref.name}/{ref.key} is not available")
        return value

    def tenant_key(self, ref: SecretKeyRef) -> ApiKeyRef:
        return ApiKeyRef(sha256=hash_api_key(self._value(ref)))

    def secret_value(self, ref: SecretKeyRef) -> SecretValueRef:
        return SecretValueRef(value=SecretStr(self._value(ref)))


def render_gateway_config(
    deployments: list[LLMDeployment],
    endpoints: Mapping[str, list[str]],
    key_source: KeySource,
    *,
    services: Mapping[str, ServiceRef] | None = None,
    engine_keys: Mapping[str, SecretKeyRef] | None = None,
    host: str = "0.0.0.0",
    port: int = 8080,
    redis: RedisConfig | None = None,
    allowed_replica_networks: list[str] | None = None,
    adapters: Sequence[LLMAdapter] = (),
    local_volumes: Mapping[str, str] | None = None,
    prefill_services: Mapping[str, ServiceRef] | None = None,
    prefill_endpoints: Mapping[str, list[str]] | None = None,
) -> GatewayConfig:
    """The gateway config for a set of LLMDeployments and the LLMAdapters served on them.

    `endpoints` maps a deployment name to static replica URLs (local mode); `services` maps it
    to the headless Service to watch (Kubernetes) and `engine_keys` to the Secret key its
    engines require (Kubernetes: the operator's Secret; local mode: the key generated for the
    run). A tenant listed in several deployments must have the same key and tenant-wide
    limits in each (they are one tenant).
    `allowed_replica_networks` (local mode: loopback) bounds where the internal API may point
    a deployment's replicas.
    `adapters` must each name one of `deployments` (same namespace); their folders are where
    `adapter_path` says, local mode's when `local_volumes` (claim → folder) is given.
    `prefill_services` / `prefill_endpoints` are a disaggregated deployment's prefill pool,
    as `services` / `endpoints` are its decode pool (ignored without spec.disaggregation).
    """
    tenants: dict[str, GatewayTenant] = {}
    rendered: list[GatewayDeployment] = []
    served = _adapters_by_deployment(deployments, adapters)
    for dep in deployments:
        gateway_adapters = [
            _gateway_adapter(a, dep, local_volumes) for a in served[dep.namespace, dep.name]
        ]
        access = [_merge_tenant(tenants, tenant, key_source) for tenant in dep.spec.tenants]
        spill = dep.spec.spillover
        enabled_spill = spill if spill is not None and spill.enabled else None
        spill_ref = None if enabled_spill is None else enabled_spill.api_key_secret_ref
        engine_key_ref = (engine_keys or {}).get(dep.name)
        rendered.append(
            GatewayDeployment(
                name=dep.name,
                model=dep.spec.model.name,
                endpoints=list(endpoints.get(dep.name, [])),
                service=(services or {}).get(dep.name),
                block_size=dep.spec.engine.block_size,
                ready_path=engine_adapter(dep.spec.engine.kind).ready_path,
                exact_continuation=dep.spec.engine.kind == "servefleet",
                kv_pull_min_tokens=256 if dep.spec.engine.kind == "servefleet" else None,
                engine_priority=dep.spec.engine.kind == "servefleet",
                kv_warm=dep.spec.kv_warm_start,
                prefix_cache_sharing=dep.spec.prefix_cache_sharing,
                max_model_len=dep.spec.engine.max_model_len,
                allowed_replica_networks=allowed_replica_networks,
                # Built-in models ship with the gateway's image too; other sources do not.
                tokenizer=dep.spec.model.source.builtin,
                pool=dep.spec.pool,
                admission=dep.spec.admission,
                tenants=access,
                adapters=gateway_adapters,
                spillover=enabled_spill,
                spillover_api_key=_secret_value(key_source, spill_ref),
                token_prices=dep.spec.token_prices,
                engine_api_key=_secret_value(key_source, engine_key_ref),
                chargeback=dep.spec.chargeback,
                prices=dep.spec.prices,
                prefill=_prefill_routing(
                    dep,
                    (prefill_services or {}).get(dep.name),
                    (prefill_endpoints or {}).get(dep.name, []),
                ),
            )
        )
    return GatewayConfig(
        host=host,
        port=port,
        redis=redis,
        tenants=list(tenants.values()),
        deployments=rendered,
    )


def _prefill_routing(
    dep: LLMDeployment, service: ServiceRef | None, endpoints: list[str]
) -> PrefillRouting | None:
    """The prefill pool as the gateway sees it; None when colocated. The protocol is the
    engine kind: how that engine joins a prefill and a decode replica."""
    block = dep.spec.disaggregation
    if block is None:
        return None
    prefill = block.prefill
    return PrefillRouting(
        endpoints=list(endpoints),
        service=service,
        pool=PoolSpec(
            min_replicas=prefill.min_replicas,
            max_replicas=prefill.max_replicas,
            per_replica_concurrency=prefill.per_replica_concurrency,
        ),
        threshold=block.threshold,
        protocol=dep.spec.engine.kind,
        bootstrap_port=SGLANG_BOOTSTRAP_PORT,
    )


def adapter_path(
    adapter: LLMAdapter,
    deployment: LLMDeployment,
    local: bool,
    volumes: Mapping[str, str] | None = None,
) -> str:
    """Where `deployment`'s engines read `adapter`'s PEFT folder: the `lora_path` the gateway
    sends to /v1/load_lora_adapter. Local mode: a pvc source is the folder its claim is mapped
    to (`volumes`, `servefleet up --volume CLAIM=DIR`) joined with `pvc.path`; every other
    source is fetched by the engine itself, as on Kubernetes (`api.lora_source`)."""
    spec = deployment.spec
    source = adapter.spec.source
    if local and source.pvc is not None:
        return local_pvc_folder(source.pvc, volumes or {}, f"LLMAdapter {adapter.name}: source.pvc")
    # Kubernetes: what the engine pods reach without a new volume; the operator renders only
    # adapters it accepted (local mode checks them at start), so a refusal here is a bug.
    return kube_lora_path(source, spec.model, spec.engine)


def _adapters_by_deployment(
    deployments: Sequence[LLMDeployment], adapters: Sequence[LLMAdapter]
) -> dict[tuple[str, str], list[LLMAdapter]]:
    """Each deployment's adapters; one naming a deployment not rendered here is an error
    (silently serving nothing for it would hide a mistake)."""
    served: dict[tuple[str, str], list[LLMAdapter]] = {
        (d.namespace, d.name): [] for d in deployments
    }
    for adapter in adapters:
        key = (adapter.namespace, adapter.spec.deployment)
        if key not in served:
            raise ValueError(
                f"LLMAdapter {adapter.name}: deployment {adapter.spec.deployment} (namespace "
                f"{adapter.namespace}) is not among the deployments"
            )
        served[key].append(adapter)
    return served


def _gateway_adapter(
    adapter: LLMAdapter,
    deployment: LLMDeployment,
    local_volumes: Mapping[str, str] | None,
) -> GatewayAdapter:
    local = local_volumes is not None  # local mode maps claims to folders; Kubernetes mounts
    return GatewayAdapter(
        name=adapter.served_name,
        path=adapter_path(adapter, deployment, local, local_volumes),
        tenants=list(adapter.spec.tenants) or None,
    )


def _merge_tenant(
    tenants: dict[str, GatewayTenant], tenant: TenantSpec, key_source: KeySource
) -> TenantAccess:
    """Adds a deployment's tenant to `tenants` (one entry per name, keys merged) and returns
    its access to that deployment."""
    key = key_source.tenant_key(tenant.api_key_secret_ref)
    known = tenants.get(tenant.name)
    if known is None:
        tenants[tenant.name] = GatewayTenant(name=tenant.name, api_keys=[key], limits=tenant.limits)
    else:
        if known.limits != tenant.limits:
            raise ValueError(f"tenant {tenant.name}: tenant-wide limits differ between deployments")
        if key not in known.api_keys:
            known.api_keys.append(key)
    return TenantAccess(
        name=tenant.name,
        traffic_class=tenant.traffic_class,
        weight=tenant.weight,
        model_limits=tenant.model_limits,
    )


def _secret_value(key_source: KeySource, ref: SecretKeyRef | None) -> SecretValueRef | None:
    return None if ref is None else key_source.secret_value(ref)
