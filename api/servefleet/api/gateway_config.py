"""The gateway's configuration: one pydantic model for Kubernetes and local mode alike.

The operator renders it into a ConfigMap (keys stay in Secrets, mounted as files) and
`servefleet up` renders it in process; both call `servefleet.api.gateway_render`, so the two
modes cannot drift. Deployment-level settings reuse the LLMDeployment sub-models unchanged.

Keys never appear in clear text: a tenant key is referenced by its SHA-256, a file or an
environment variable; a value held in memory (local mode) is a `SecretStr` that prints as stars.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from servefleet.api.batches import BatchConfig
from servefleet.api.budgets import TokenPrices
from servefleet.api.cache_salt import PrefixCacheSharing
from servefleet.api.chargeback_spec import ChargebackSpec
from servefleet.api.kv_warm import KVWarmStartSpec
from servefleet.api.llmdeployment import (
    AdmissionSpec,
    PoolSpec,
    SpilloverSpec,
    TenantLimits,
)
from servefleet.api.lora import ADAPTER_NAME
from servefleet.api.prices_spec import PricesSpec
from servefleet.api.replica_endpoints import parse_networks, replica_endpoint_problem

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

    name: str = Field(
        # Tenants from Kubernetes routes are `<namespace>/<name>` (conventions.route_scoped).
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z]([-a-z0-9]*[a-z0-9])?$",
        max_length=127,
    )
    api_keys: list[ApiKeyRef] = Field(min_length=1)
    limits: TenantLimits = Field(default_factory=TenantLimits)


class TenantAccess(ConfigModel):
    """A tenant's right to use one deployment's model, and how it is treated there."""

    name: str
    traffic_class: Literal["interactive", "batch"] = "interactive"
    weight: float = Field(default=1.0, gt=0)
    model_limits: TenantLimits | None = None


class GatewayAdapter(ConfigModel):
    """A LoRA adapter served on a deployment's pool (an LLMAdapter as the gateway sees it)."""

    name: str = Field(
        pattern=ADAPTER_NAME.pattern, description="The model name clients send for it."
    )
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="Its PEFT folder as the engines see it: the `lora_path` the gateway sends "
        "to /v1/load_lora_adapter when it loads the adapter on a replica.",
    )
    tenants: list[str] | None = Field(
        default=None, description="Tenants of the deployment that may use it; None: all."
    )


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


class PrefillRouting(ConfigModel):
    """The prefill pool of a disaggregated deployment, as the gateway sees it
    (`servefleet.api.disaggregation`); `GatewayDeployment.endpoints`/`service` is the decode
    pool."""

    endpoints: list[str] = Field(
        default_factory=list, description="Static prefill replica base URLs (local mode)."
    )
    service: ServiceRef | None = Field(default=None, description="EndpointSlices to watch.")
    pool: PoolSpec = Field(default_factory=PoolSpec, description="Prefill pool bounds.")
    threshold: int = Field(
        default=256,
        ge=0,
        description="Uncached prompt tokens below which the decode replica prefills itself.",
    )
    protocol: Literal["servefleet", "vllm", "sglang"] = Field(
        default="servefleet",
        description="How prefill and decode are joined: servefleet (the decode engine pulls "
        "from the named prefill engine), vllm (NIXL proxy flow), sglang (bootstrap room).",
    )
    bootstrap_port: int = Field(
        default=8998, ge=1, le=65535, description="SGLang's disaggregation bootstrap port."
    )


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
    adapters: list[GatewayAdapter] = Field(
        default_factory=list, description="LoRA adapters the replicas load on demand."
    )
    spillover: SpilloverSpec | None = None
    spillover_api_key: SecretValueRef | None = None
    token_prices: TokenPrices | None = Field(
        default=None, description="Prices for tenants' cost budgets (`servefleet.api.budgets`)."
    )
    engine_api_key: SecretValueRef | None = Field(
        default=None,
        description="Key the engines require (sent as a Bearer token); unset: engines are open.",
    )
    default_max_tokens: int = Field(
        default=512,
        ge=1,
        description="Completion tokens reserved per choice for a chat without max_tokens when "
        "the gateway does not know the context length (no tokenizer, no max_model_len); "
        "otherwise it reserves what the engine allows (`servefleet.api.max_tokens`).",
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
    kv_pull_min_tokens: int | None = Field(
        default=256,
        ge=1,
        description="A request of at least this many prompt tokens that is routed away from "
        "the replica its prefix is affine to names that replica in `kv_transfer_params`, so "
        "the engine pulls the prefix's KV blocks from it instead of recomputing them "
        "(servefleet engines); null: never (vLLM/SGLang).",
    )
    kv_pull_deadline_seconds: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description="How long an engine may spend pulling before it recomputes the rest.",
    )
    kv_warm: KVWarmStartSpec = Field(
        default_factory=KVWarmStartSpec,
        description="spec.kvWarmStart: the blocks and deadline of each warm call.",
    )
    prefix_cache_sharing: PrefixCacheSharing = Field(
        default="tenant",
        description="spec.prefixCacheSharing: tenant salts each request to the engines with "
        "its tenant (`servefleet.api.cache_salt`); deployment forwards the tenant's own salt.",
    )
    engine_priority: bool = Field(
        default=True,
        description="The engines take the gateway's `priority` (servefleet's scheduler): a "
        "batch tenant's requests are sent with priority `batch`. False for vLLM/SGLang, "
        "which are sent none. A tenant never sets it.",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        description="The engines' context length (tokens); unset: the model's, when the "
        "gateway has its tokenizer. A prompt whose length proves it cannot fit is a 400 "
        "before anything tokenizes it.",
    )
    chargeback: ChargebackSpec | None = Field(
        default=None,
        description="The deployment's spec.chargeback: idle policy of its usage report "
        "(GET /internal/usage).",
    )
    prices: PricesSpec | None = Field(
        default=None, description="spec.prices (deprecated spellings mapped): the report's."
    )
    prefill: PrefillRouting | None = Field(
        default=None,
        description="Disaggregated prefill/decode: the prefill pool; unset: colocated.",
    )
    allowed_replica_networks: list[str] | None = Field(
        default=None,
        description="CIDRs that POST /internal/deployments/<name>/replicas may point at "
        "(local mode renders 127.0.0.1/32); unset: the addresses of `endpoints`, and none "
        "when there are none.",
    )

    @model_validator(mode="after")
    def _spill_key(self) -> GatewayDeployment:
        if self.spillover is not None and self.spillover.enabled and self.spillover_api_key is None:
            raise ValueError(f"deployment {self.name}: spillover needs spilloverApiKey")
        for endpoint in self.endpoints:
            problem = replica_endpoint_problem(endpoint)
            if problem is not None:
                raise ValueError(f"deployment {self.name}: endpoint {endpoint!r} {problem}")
        self._check_adapters()
        try:
            parse_networks(self.allowed_replica_networks or ())
        except ValueError as exc:
            raise ValueError(f"deployment {self.name}: allowed_replica_networks: {exc}") from None
        return self

    def _check_adapters(self) -> None:
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"deployment {self.name}: adapters: duplicate names")
        if self.model in names:
            raise ValueError(f"deployment {self.name}: adapter {self.model} is the base model")
        tenants = {t.name for t in self.tenants}
        for adapter in self.adapters:
            unknown = sorted(set(adapter.tenants or ()) - tenants)
            if unknown:
                raise ValueError(
                    f"deployment {self.name}: adapter {adapter.name}: tenants "
                    f"{', '.join(unknown)} do not use the deployment"
                )

    def adapter_tenants(self, adapter: GatewayAdapter) -> list[TenantAccess]:
        """The deployment's tenants that may use `adapter`."""
        if adapter.tenants is None:
            return list(self.tenants)
        allowed = set(adapter.tenants)
        return [t for t in self.tenants if t.name in allowed]


class RedisConfig(ConfigModel):
    url: str = Field(pattern=r"^(redis|rediss|unix)://.+")
    key_prefix: str = "servefleet:limits"
    timeout_seconds: float = Field(default=0.25, gt=0)
    gateway_replicas: int = Field(
        default=1, ge=1, description="While Redis is down each replica enforces 1/N of a limit."
    )
    password: SecretValueRef | None = Field(
        default=None,
        description="Redis' password (AUTH), e.g. a mounted Secret file; kept out of `url`, "
        "which lives in a ConfigMap.",
    )


class GatewayConfig(ConfigModel):
    host: str = "0.0.0.0"
    port: int = Field(default=8080, ge=0, le=65535)
    redis: RedisConfig | None = None
    tenants: list[GatewayTenant] = Field(default_factory=list)
    deployments: list[GatewayDeployment] = Field(default_factory=list)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    internal_api_key: SecretValueRef | None = Field(
        default=None,
        description="Bearer key of every internal path but /health (/metrics, /internal/*); "
        "required whenever the internal port is served. Unset: the internal app answers "
        "nothing but /health (in-process use reads the gateway directly).",
    )
    internal_port: int | None = Field(
        default=8090,
        ge=0,
        le=65535,
        description="Port of /metrics and /internal/* (never the tenant port: metrics name "
        "tenants); unset = not served (in-process use).",
    )
    usage_prometheus_url: str | None = Field(
        default=None,
        pattern=r"^https?://[^@/]+(/.*)?$",
        description="Prometheus that GET /internal/usage reads counter increases from (the "
        "platform admin's; no credentials in the URL). Unset: that path answers 501.",
    )
    batch: BatchConfig | None = Field(
        default=None, description="The Batch API (/v1/files, /v1/batches); unset: not served."
    )
    tenant_series_limit: int = Field(
        default=100,
        ge=0,
        description="Tenants with their own metric series; later ones are summed in "
        'tenant="_other", so a tenant-heavy gateway cannot flood Prometheus.',
    )
    spillover_allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Spill-over targets of Kubernetes routes that may be loopback, link-local "
        "or private: host names, or CIDRs their addresses must be in (the platform admin's; "
        "any other such baseURL is refused, `servefleet.gateway.spill_guard`).",
    )

    @model_validator(mode="after")
    def _references(self) -> GatewayConfig:
        if self.internal_port is not None and self.internal_port == self.port != 0:
            raise ValueError("internal_port must differ from the tenant port")
        names = [d.name for d in self.deployments]
        if len(set(names)) != len(names):
            raise ValueError("deployments: duplicate names")
        # A model name is what a tenant asks for: unique among the deployments it reaches
        # (two namespaces' routes may each serve "llama" to their own tenants).
        reached: dict[tuple[str, str], str] = {}
        for deployment in self.deployments:
            served = [(deployment.model, deployment.tenants)] + [
                (a.name, deployment.adapter_tenants(a)) for a in deployment.adapters
            ]
            for model, accesses in served:
                for access in accesses:
                    other = reached.setdefault((access.name, model), deployment.name)
                    if other != deployment.name:
                        raise ValueError(
                            f"deployments {other} and {deployment.name}: two deployments serve "
                            f"the same model name {model} to tenant {access.name}"
                        )
        tenants = {t.name for t in self.tenants}
        if len(tenants) != len(self.tenants):
            raise ValueError("tenants: duplicate names")
        costed = {t.name for t in self.tenants if t.limits.has_cost_budget}
        for deployment in self.deployments:
            for access in deployment.tenants:
                if access.name not in tenants:
                    raise ValueError(
                        f"deployment {deployment.name}: tenant {access.name} is not in tenants"
                    )
                own = access.model_limits is not None and access.model_limits.has_cost_budget
                if deployment.token_prices is None and (own or access.name in costed):
                    raise ValueError(
                        f"deployment {deployment.name}: tenant {access.name} has a cost budget "
                        "but the deployment has no tokenPrices"
                    )
        return self
