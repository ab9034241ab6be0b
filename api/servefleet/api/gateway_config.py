"""The gateway's configuration: one pydantic model for Kubernetes and local mode alike.

The operator renders it into a ConfigMap (keys stay in Secrets, mounted as files) and
`servefleet up` renders it in process; both call `render_gateway_config`, so the two modes
cannot drift. Deployment-level settings reuse the LLMDeployment sub-models unchanged.

Keys never appear in clear text: a tenant key is referenced by its SHA-256, a file or an
environment variable; a value held in memory (local mode) is a `SecretStr` that prints as stars.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from servefleet.api.engines import engine_adapter
from servefleet.api.llmdeployment import (
    AdmissionSpec,
    LLMDeployment,
    PoolSpec,
    SecretKeyRef,
    SpilloverSpec,
    TenantLimits,
    TenantSpec,
)

SHA256_HEX = r"^[0-9a-f]{64}$"


class ConfigModel(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def hash_api_key(key: str) -> str:
    """The only form in which the gateway keeps a tenant's key."""
    return hashlib.sha256(key.strip().encode()).hexdigest()


class SecretValueRef(ConfigModel):
    """Where a secret value comes from: a file (a mounted Secret), an env var, or memory."""

    file: str | None = Field(default=None, description="File holding the value (a mounted Secret).")
    env: str | None = Field(default=None, description="Environment variable holding the value.")
    value: SecretStr | None = Field(
        default=None, description="The value itself (in-process configs only; never printed)."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> SecretValueRef:
        if sum(x is not None for x in (self.file, self.env, self.value)) != 1:
            raise ValueError("a secret reference needs exactly one of file, env or value")
        return self

    def read(self, environ: Mapping[str, str] | None = None) -> str:
        """The value; raises ValueError naming the source when it is missing."""
        if self.value is not None:
            return self.value.get_secret_value()
        if self.file is not None:
            try:
                return Path(self.file).read_text().strip()
            except OSError as exc:
                raise ValueError(f"cannot read secret file {self.file}: {exc.strerror}") from exc
        env = os.environ if environ is None else environ
        assert self.env is not None
        found = env.get(self.env)
        if found is None:
            raise ValueError(f"environment variable {self.env} is not set")
        return found.strip()


class ApiKeyRef(ConfigModel):
    """A tenant key: its SHA-256 (preferred), or where to read the key to hash it at start."""

    sha256: str | None = Field(default=None, pattern=SHA256_HEX, description="SHA-256 of the key.")
    source: SecretValueRef | None = Field(default=None, description="Where to read the key.")

    @model_validator(mode="after")
    def _exactly_one(self) -> ApiKeyRef:
        if (self.sha256 is None) == (self.source is None):
            raise ValueError("an API key reference needs exactly one of sha256 or source")
        return self

    def digest(self, environ: Mapping[str, str] | None = None) -> str:
        if self.sha256 is not None:
            return self.sha256
        assert self.source is not None
        return hash_api_key(self.source.read(environ))


class GatewayTenant(ConfigModel):
    """A tenant: its keys and its tenant-wide limits (shared across every model)."""

    name: str = Field(pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    api_keys: list[ApiKeyRef] = Field(min_length=1)
    limits: TenantLimits = Field(default_factory=TenantLimits)


class TenantAccess(ConfigModel):
    """A tenant's right to use one deployment's model, and how it is treated there."""

    name: str
    traffic_class: Literal["interactive", "batch"] = "interactive"
    weight: float = Field(default=1.0, gt=0)
    model_limits: TenantLimits | None = None


class ServiceRef(ConfigModel):
    """The headless Service whose EndpointSlices list a deployment's replicas."""

    namespace: str
    name: str
    port_name: str | None = Field(default=None, description="Port to use; the first if unset.")
    scheme: Literal["http", "https"] = "http"


class RoutingConfig(ConfigModel):
    """Prefix affinity and health knobs shared by every deployment."""

    affinity_blocks: int = Field(default=4, ge=0, description="Prompt blocks hashed for affinity.")
    chars_per_token: float = Field(default=4.0, gt=0, description="Fast token estimate.")
    affinity_slack: int = Field(
        default=2, ge=0, description="Extra requests the affine replica may carry over the least."
    )
    eject_seconds: float = Field(default=1.0, gt=0, description="First ejection back-off.")
    eject_max_seconds: float = Field(default=30.0, gt=0)
    probe_interval_seconds: float = Field(default=1.0, gt=0, description="Readiness probing.")


class GatewayDeployment(ConfigModel):
    """One LLMDeployment as the gateway sees it."""

    name: str
    model: str = Field(description="The model name clients send.")
    endpoints: list[str] = Field(
        default_factory=list, description="Static replica base URLs (local mode)."
    )
    service: ServiceRef | None = Field(default=None, description="EndpointSlices to watch.")
    block_size: int = Field(default=16, ge=1, description="Engine KV block size, for affinity.")
    ready_path: str = Field(
        default="/ready",
        description="The engine's readiness path (from its adapter: vLLM answers /health only "
        "once warm, SGLang /health_generate).",
    )
    tokenizer: str | None = Field(
        default=None,
        description="Model source (built-in name, GGUF file, HF folder) whose tokenizer counts "
        "prompt tokens at admission; the fast estimate is used when unset or not available.",
    )
    pool: PoolSpec = Field(default_factory=PoolSpec)
    admission: AdmissionSpec = Field(default_factory=AdmissionSpec)
    tenants: list[TenantAccess] = Field(default_factory=list)
    spillover: SpilloverSpec | None = None
    spillover_api_key: SecretValueRef | None = None
    engine_api_key: SecretValueRef | None = Field(
        default=None,
        description="Key the engines require (sent as a Bearer token); unset: engines are open.",
    )
    default_max_tokens: int = Field(
        default=512, ge=1, description="Reserved completion tokens when a request sets none."
    )
    cold_start_seconds: float = Field(
        default=30.0, gt=0, description="Cold start assumed until one is measured."
    )
    service_seconds: float = Field(
        default=2.0, gt=0, description="Request duration assumed until one is measured."
    )
    upstream_timeout_seconds: float = Field(default=300.0, gt=0)
    connect_timeout_seconds: float = Field(default=5.0, gt=0)
    max_continuations: int = Field(
        default=2,
        ge=0,
        description="Times a stream broken by its replica is continued on another one.",
    )
    exact_continuation: bool = Field(
        default=True,
        description="The engines resume from token ids (servefleet); false for vLLM/SGLang, "
        "which are sent the delivered text instead (`servefleet.api.stream_resume`).",
    )

    @model_validator(mode="after")
    def _spill_key(self) -> GatewayDeployment:
        if self.spillover is not None and self.spillover.enabled and self.spillover_api_key is None:
            raise ValueError(f"deployment {self.name}: spillover needs spilloverApiKey")
        for endpoint in self.endpoints:
            if not re.match(r"^https?://[^/]+", endpoint):
                raise ValueError(f"deployment {self.name}: endpoint {endpoint!r} is not a URL")
        return self


class RedisConfig(ConfigModel):
    url: str = Field(pattern=r"^(redis|rediss|unix)://.+")
    key_prefix: str = "servefleet:limits"
    timeout_seconds: float = Field(default=0.25, gt=0)
    gateway_replicas: int = Field(
        default=1, ge=1, description="While Redis is down each replica enforces 1/N of a limit."
    )


class GatewayConfig(ConfigModel):
    host: str = "0.0.0.0"
    port: int = Field(default=8080, ge=0, le=65535)
    redis: RedisConfig | None = None
    tenants: list[GatewayTenant] = Field(default_factory=list)
    deployments: list[GatewayDeployment] = Field(default_factory=list)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    internal_api_key: SecretValueRef | None = Field(
        default=None, description="Bearer key for POST /internal/...; unset = no auth (local mode)."
    )
    internal_port: int | None = Field(
        default=8090,
        ge=0,
        le=65535,
        description="Port of /metrics and /internal/* (never the tenant port: metrics name "
        "tenants); unset = not served (in-process use).",
    )
    tenant_series_limit: int = Field(
        default=100,
        ge=0,
        description="Tenants with their own metric series; later ones are summed in "
        'tenant="_other", so a tenant-heavy gateway cannot flood Prometheus.',
    )

    @model_validator(mode="after")
    def _references(self) -> GatewayConfig:
        if self.internal_port is not None and self.internal_port == self.port != 0:
            raise ValueError("internal_port must differ from the tenant port")
        names = [d.name for d in self.deployments]
        if len(set(names)) != len(names):
            raise ValueError("deployments: duplicate names")
        models = [d.model for d in self.deployments]
        if len(set(models)) != len(models):
            raise ValueError("deployments: two deployments serve the same model name")
        tenants = {t.name for t in self.tenants}
        if len(tenants) != len(self.tenants):
            raise ValueError("tenants: duplicate names")
        for deployment in self.deployments:
            for access in deployment.tenants:
                if access.name not in tenants:
                    raise ValueError(
                        f"deployment {deployment.name}: tenant {access.name} is not in tenants"
                    )
        return self


# --------------------------------------------------------------------------- rendering


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
) -> GatewayConfig:
    """The gateway config for a set of LLMDeployments.

    `endpoints` maps a deployment name to static replica URLs (local mode); `services` maps it
    to the headless Service to watch (Kubernetes) and `engine_keys` to the Secret key its
    engine pods require (Kubernetes; local engines are open). A tenant listed in several
    deployments must have the same key and tenant-wide limits in each (they are one tenant).
    """
    tenants: dict[str, GatewayTenant] = {}
    rendered: list[GatewayDeployment] = []
    for dep in deployments:
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
                # Built-in models ship with the gateway's image too; other sources do not.
                tokenizer=dep.spec.model.source.builtin,
                pool=dep.spec.pool,
                admission=dep.spec.admission,
                tenants=access,
                spillover=enabled_spill,
                spillover_api_key=_secret_value(key_source, spill_ref),
                engine_api_key=_secret_value(key_source, engine_key_ref),
            )
        )
    return GatewayConfig(
        host=host,
        port=port,
        redis=redis,
        tenants=list(tenants.values()),
        deployments=rendered,
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
