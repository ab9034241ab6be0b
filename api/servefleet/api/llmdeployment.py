"""The LLMDeployment resource: one pydantic model shared by the CRD, the operator,
the gateway and local mode, so the schema Kubernetes enforces and the one Python
validates can never disagree (the CRD is generated from these classes).

Cross-field rules live twice on purpose: as pydantic validators (local mode, unit
tests, the operator) and as CEL rules in `x-kubernetes-validations` (the API server
rejects a bad CR before anything reconciles it). Both carry the same message.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonDict

API_GROUP = "servefleet.io"
API_VERSION = "v1alpha1"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
SHORT_NAME = "llmd"
FULL_API_VERSION = f"{API_GROUP}/{API_VERSION}"

# Child objects get names like "<name>-engine-abcde": keep the CR name short enough.
MAX_NAME_LENGTH = 40

DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
# Kubernetes resource quantity (e.g. "500m", "4Gi", "1").
QUANTITY = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
# kvCacheMemory as a string: a fraction of free accelerator memory ("0.9") or a size ("4Gi").
KV_CACHE_MEMORY = r"^(0?\.[0-9]+|1(\.0*)?|[0-9]+(Ki|Mi|Gi|Ti|K|M|G|T)?)$"

Quantity = Annotated[int | str, Field(description="A Kubernetes quantity, e.g. 1, '500m', '4Gi'.")]


def _cel(rule: str, message: str) -> JsonDict:
    return {"rule": rule, "message": message}


class ApiModel(BaseModel):
    """Base for every part of the spec: camelCase on the wire, unknown fields are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict Kubernetes and YAML files see (unset optionals left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# --------------------------------------------------------------------------- model


class SecretKeyRef(ApiModel):
    """A key in a Secret of the same namespace (in local mode: a Secret document in the
    same file, or an environment variable; see `servefleet.api.manifests`)."""

    name: str = Field(description="Name of the Secret.", pattern=DNS_SUBDOMAIN, max_length=253)
    key: str = Field(description="Key inside the Secret whose value is used.", min_length=1)


class PvcModelSource(ApiModel):
    """A Hugging Face model folder (config.json, tokenizer, safetensors) on a volume."""

    claim_name: str = Field(
        description="PersistentVolumeClaim holding the model folder; mounted read-only."
    )
    path: str = Field(
        default="",
        description="Folder of the model inside the volume, relative to its root ('' = the root).",
        pattern=r"^[^/].*$|^$",
    )


class ModelSource(ApiModel):
    """Where the weights come from; exactly one of builtin, pvc or url."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "[has(self.builtin), has(self.pvc), has(self.url)].exists_one(x, x)",
                    "model.source needs exactly one of builtin, pvc or url",
                )
            ]
        }
    )

    builtin: str | None = Field(
        default=None,
        description="A model shipped with the servefleet image, e.g. 'smollm2-135m-instruct'.",
        pattern=r"^[a-z0-9][a-z0-9._-]*$",
    )
    pvc: PvcModelSource | None = Field(
        default=None, description="A Hugging Face model folder on a PersistentVolumeClaim."
    )
    url: str | None = Field(
        default=None,
        description="http(s) URL of a weights file (e.g. GGUF), fetched before the engine starts.",
        pattern=r"^https?://.+",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        if sum(x is not None for x in (self.builtin, self.pvc, self.url)) != 1:
            raise ValueError("model.source needs exactly one of builtin, pvc or url")
        return self


Quantization = Literal["none", "q4_0", "q4_1", "q8_0", "awq", "gptq", "fp8"]


class ModelSpec(ApiModel):
    """The model this deployment serves."""

    name: str = Field(
        description="Model name clients send in the OpenAI 'model' field.",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
    )
    source: ModelSource = Field(description="Where the weights come from.")
    quantization: Quantization = Field(
        default="none",
        description="Weight quantization; 'none' loads weights as stored (GGUF carries its own).",
    )


# --------------------------------------------------------------------------- engine


EngineKind = Literal["servefleet", "vllm", "sglang"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class EnvVar(ApiModel):
    """An environment variable for the engine container."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!(has(self.value) && has(self.secretKeyRef))",
                    "env: set value or secretKeyRef, not both",
                )
            ]
        }
    )

    name: str = Field(description="Variable name.", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    value: str | None = Field(default=None, description="Literal value.")
    secret_key_ref: SecretKeyRef | None = Field(
        default=None, description="Take the value from a Secret key."
    )

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value is not None and self.secret_key_ref is not None:
            raise ValueError("env: set value or secretKeyRef, not both")
        return self


class ResourceRequirements(ApiModel):
    """Container resources, as in a Pod; use 'nvidia.com/gpu' for GPUs."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="Minimum resources, e.g. {cpu: '2', memory: 8Gi}."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="Maximum resources, e.g. {'nvidia.com/gpu': 1}."
    )

    @field_validator("requests", "limits")
    @classmethod
    def _quantities(cls, value: dict[str, int | str]) -> dict[str, int | str]:
        for name, qty in value.items():
            if isinstance(qty, str) and not re.match(QUANTITY, qty):
                raise ValueError(f"resource {name!r}: {qty!r} is not a Kubernetes quantity")
        return value

    def gpus(self) -> int:
        """GPUs asked for (limits win, as for extended resources requests must equal limits)."""
        raw = self.limits.get("nvidia.com/gpu", self.requests.get("nvidia.com/gpu", 0))
        return int(raw)


class EngineSpec(ApiModel):
    """The inference engine running each replica."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.kind != 'servefleet' || self.tensorParallelSize == 1",
                    "engine.tensorParallelSize > 1 needs engine.kind vllm or sglang "
                    "(servefleet runs one GPU per replica)",
                ),
                _cel(
                    "self.kind != 'servefleet' || self.dtype != 'float16'",
                    "engine.kind servefleet supports dtype auto, float32 or bfloat16",
                ),
            ]
        }
    )

    kind: EngineKind = Field(
        default="servefleet", description="Engine: servefleet, vllm or sglang."
    )
    image: str | None = Field(
        default=None,
        description="Container image; empty means the adapter's default for this kind.",
        min_length=1,
    )
    args: list[str] = Field(
        default_factory=list,
        max_length=200,
        description="Extra command-line flags appended to the engine's.",
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=200, description="Extra environment variables."
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Container resources ('nvidia.com/gpu' for GPUs).",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="GPUs one replica shards the model over (vllm/sglang only).",
    )
    block_size: int = Field(default=16, ge=1, le=1024, description="Tokens per KV-cache block.")
    kv_cache_memory: int | str | None = Field(
        default=None,
        description="KV-cache size: bytes (int), a fraction of free memory ('0.9'), or '4Gi'.",
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        description="Most sequences one replica batches at once (engine default if unset).",
    )
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, description="Token budget of one engine step (engine default if unset)."
    )
    prefix_caching: bool = Field(
        default=True, description="Reuse KV blocks of shared prompt prefixes."
    )
    dtype: Dtype = Field(
        default="auto", description="Compute dtype of the weights and activations."
    )
    startup_timeout_seconds: int = Field(
        default=900,
        ge=10,
        description="Longest a replica may take to load and warm the model before it is restarted.",
    )
    drain_timeout_seconds: int = Field(
        default=30,
        ge=0,
        description="How long a stopping replica finishes in-flight requests (SIGTERM drain).",
    )

    @field_validator("kv_cache_memory")
    @classmethod
    def _kv_cache_memory(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value <= 0:
            raise ValueError("engine.kvCacheMemory in bytes must be positive")
        if isinstance(value, str) and not re.match(KV_CACHE_MEMORY, value):
            raise ValueError(
                f"engine.kvCacheMemory {value!r}: use bytes, a fraction like '0.9', "
                "or a size like '4Gi'"
            )
        return value

    @model_validator(mode="after")
    def _engine_rules(self) -> EngineSpec:
        if self.kind == "servefleet" and self.tensor_parallel_size != 1:
            raise ValueError(
                "engine.tensorParallelSize > 1 needs engine.kind vllm or sglang "
                "(servefleet runs one GPU per replica)"
            )
        if self.kind == "servefleet" and self.dtype == "float16":
            raise ValueError("engine.kind servefleet supports dtype auto, float32 or bfloat16")
        return self


# --------------------------------------------------------------------------- pool and scaling


class PoolSpec(ApiModel):
    """Bounds of the replica pool; the desired count itself is `spec.replicas`."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.minReplicas <= self.maxReplicas",
                    "pool.minReplicas must be <= pool.maxReplicas",
                )
            ]
        }
    )

    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="The warm pool: replicas kept loaded even when idle (0 = scale to zero).",
    )
    max_replicas: int = Field(
        default=4, ge=1, le=1000, description="Most replicas the autoscaler may run."
    )
    scale_down_delay: float = Field(
        default=300.0, ge=0, description="Seconds demand must stay low before a replica is removed."
    )
    per_replica_concurrency: int = Field(
        default=16,
        ge=1,
        description="Most requests the gateway sends one replica at once (its batch size).",
    )

    @model_validator(mode="after")
    def _bounds(self) -> PoolSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("pool.minReplicas must be <= pool.maxReplicas")
        return self


class AutoscalingSpec(ApiModel):
    """Queue-depth autoscaling of the pool."""

    enabled: bool = Field(default=True, description="Let the autoscaler set spec.replicas.")
    target_per_replica: float = Field(
        default=8.0, gt=0, description="Requests (queued + running) one replica should carry."
    )
    queue_wait_target: float = Field(
        default=2.0,
        gt=0,
        description="Seconds of gateway queue wait to stay under; scale up when it is missed.",
    )
    ttft_target: float | None = Field(
        default=None,
        gt=0,
        description="Seconds of time-to-first-token to stay under (unset = not watched).",
    )
    interval: float = Field(default=5.0, gt=0, description="Seconds between autoscaling decisions.")


class AdmissionSpec(ApiModel):
    """The gateway's bounded queue for this deployment."""

    max_queue_depth: int = Field(
        default=256, ge=0, description="Most requests waiting in the gateway; past it: 503."
    )
    max_queue_wait: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a request may be predicted to wait; past it: 503 with Retry-After.",
    )


# --------------------------------------------------------------------------- tenants


TrafficClass = Literal["interactive", "batch"]


class TenantLimits(ApiModel):
    """Rate limits of a tenant; unset means unlimited."""

    requests_per_minute: int | None = Field(default=None, ge=1, description="Requests per minute.")
    tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="Prompt + completion tokens per minute (reserved at admission).",
    )
    max_concurrent_requests: int | None = Field(
        default=None, ge=1, description="Requests in flight at once."
    )
    daily_token_budget: int | None = Field(default=None, ge=1, description="Tokens per UTC day.")


class TenantSpec(ApiModel):
    """A tenant allowed to call this deployment's model. The key is only referenced:
    it lives in a Secret, never in the CR (CRs are readable by far more people)."""

    name: str = Field(
        description="Tenant name (a DNS label), used in metrics and limits.",
        pattern=DNS_LABEL,
        max_length=63,
    )
    api_key_secret_ref: SecretKeyRef = Field(description="Secret key holding the tenant's API key.")
    traffic_class: TrafficClass = Field(
        default="interactive", description="interactive goes ahead of batch; batch is shed first."
    )
    weight: float = Field(
        default=1.0, gt=0, description="Share of the pool in weighted fair queuing."
    )
    limits: TenantLimits = Field(
        default_factory=TenantLimits,
        description="Tenant-wide limits across every model (a tenant listed in several "
        "LLMDeployments must carry the same ones).",
    )
    model_limits: TenantLimits | None = Field(
        default=None, description="Extra limits for this deployment's model only."
    )


# --------------------------------------------------------------------------- spill-over


class SpilloverWhen(ApiModel):
    """When a request goes to the hosted API instead of the pool."""

    queue_full: bool = Field(
        default=True, description="The gateway queue is at admission.maxQueueDepth."
    )
    predicted_wait_over_seconds: float | None = Field(
        default=None, gt=0, description="The predicted queue wait is over this many seconds."
    )
    no_ready_replica: bool = Field(
        default=True, description="No replica is ready (scaled to zero, cold start)."
    )


class SpilloverSpec(ApiModel):
    """Send overflow to an OpenAI-compatible hosted API."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!self.enabled || (has(self.baseURL) && has(self.model) "
                    "&& has(self.apiKeySecretRef))",
                    "spillover.enabled needs baseURL, model and apiKeySecretRef",
                )
            ]
        }
    )

    enabled: bool = Field(default=False, description="Turn spill-over on.")
    base_url: str | None = Field(
        default=None,
        alias="baseURL",
        description="Base URL of the hosted API, e.g. https://api.example.com/v1.",
        pattern=r"^https?://.+",
    )
    model: str | None = Field(
        default=None, description="Model name at the hosted API.", min_length=1
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret key holding the hosted API's key."
    )
    tenants: list[Annotated[str, Field(max_length=63)]] = Field(
        default_factory=list,
        max_length=100,
        description="Tenants that may spill over; empty means all of them.",
    )
    when: SpilloverWhen = Field(
        default_factory=SpilloverWhen, description="Conditions that trigger a spill-over."
    )
    max_requests_per_minute: int = Field(
        default=60,
        ge=1,
        description="Cap on spilled requests per minute, so a storm cannot run up the bill.",
    )
    timeout_seconds: float = Field(
        default=60.0, gt=0, description="Cut an upstream request after this long."
    )

    @model_validator(mode="after")
    def _needs_target(self) -> SpilloverSpec:
        if self.enabled and (
            self.base_url is None or self.model is None or self.api_key_secret_ref is None
        ):
            raise ValueError("spillover.enabled needs baseURL, model and apiKeySecretRef")
        return self


# --------------------------------------------------------------------------- spec


class LLMDeploymentSpec(ApiModel):
    """A warm pool of engine replicas serving one model behind the gateway."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!has(self.replicas) || (self.replicas >= self.pool.minReplicas "
                    "&& self.replicas <= self.pool.maxReplicas)",
                    "replicas must be within [pool.minReplicas, pool.maxReplicas]",
                ),
                _cel(
                    "!has(self.spillover) || !has(self.spillover.tenants) || "
                    "self.spillover.tenants.all(t, has(self.tenants) "
                    "&& self.tenants.exists(x, x.name == t))",
                    "spillover.tenants must name tenants listed in spec.tenants",
                ),
                _cel(
                    "self.engine.kind == 'servefleet' || !has(self.model.source.builtin)",
                    "model.source.builtin models run only on engine.kind servefleet",
                ),
            ]
        }
    )

    model: ModelSpec = Field(description="The model served.")
    engine: EngineSpec = Field(
        default_factory=EngineSpec, description="The engine running each replica."
    )
    replicas: int | None = Field(
        default=None,
        ge=0,
        description="Desired replicas (the scale subresource: the autoscaler or kubectl scale). "
        "Unset means pool.minReplicas.",
    )
    pool: PoolSpec = Field(default_factory=PoolSpec, description="Bounds of the replica pool.")
    autoscaling: AutoscalingSpec = Field(
        default_factory=AutoscalingSpec, description="Queue-depth autoscaling."
    )
    admission: AdmissionSpec = Field(
        default_factory=AdmissionSpec, description="The gateway's bounded queue."
    )
    tenants: list[TenantSpec] = Field(
        default_factory=list,
        max_length=100,
        description="Tenants allowed to call this model, keys by Secret reference.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    spillover: SpilloverSpec | None = Field(default=None, description="Overflow to a hosted API.")

    @model_validator(mode="after")
    def _cross_field(self) -> LLMDeploymentSpec:
        if self.replicas is not None and not (
            self.pool.min_replicas <= self.replicas <= self.pool.max_replicas
        ):
            raise ValueError("replicas must be within [pool.minReplicas, pool.maxReplicas]")
        names = [t.name for t in self.tenants]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"tenants: duplicate name(s) {', '.join(duplicates)}")
        if self.spillover is not None:
            unknown = sorted(set(self.spillover.tenants) - set(names))
            if unknown:
                raise ValueError(
                    "spillover.tenants must name tenants listed in spec.tenants "
                    f"(unknown: {', '.join(unknown)})"
                )
        if self.engine.kind != "servefleet" and self.model.source.builtin is not None:
            raise ValueError("model.source.builtin models run only on engine.kind servefleet")
        return self

    def desired_replicas(self) -> int:
        """Replicas to run now: spec.replicas, else the warm minimum, clamped to the pool."""
        wanted = self.pool.min_replicas if self.replicas is None else self.replicas
        return max(self.pool.min_replicas, min(self.pool.max_replicas, wanted))


# --------------------------------------------------------------------------- status


ConditionType = Literal["Ready", "Progressing", "Degraded"]


class Condition(ApiModel):
    """A standard Kubernetes condition."""

    type: str = Field(description="Ready, Progressing or Degraded.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason for the last transition.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str | None = Field(
        default=None,
        description="When the status last changed (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    observed_generation: int | None = Field(
        default=None, description="Generation this condition was computed for."
    )


class LLMDeploymentStatus(ApiModel):
    """What the operator observed; written through the status subresource."""

    observed_generation: int = Field(
        default=0, description="Last spec generation the operator acted on."
    )
    replicas: int = Field(
        default=0, description="Engine pods that exist (the scale subresource's status.replicas)."
    )
    desired_replicas: int = Field(default=0, description="Replicas the operator is converging to.")
    ready_replicas: int = Field(default=0, description="Replicas with the model loaded and ready.")
    warm_replicas: int = Field(
        default=0, description="Ready replicas counted toward the warm minimum."
    )
    queue_depth: int = Field(
        default=0, description="Requests waiting in the gateway for this deployment."
    )
    endpoint: str = Field(
        default="", description="OpenAI base URL that serves this model (through the gateway)."
    )
    selector: str = Field(
        default="", description="Label selector of the engine pods (for the scale subresource)."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing and Degraded.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)


# --------------------------------------------------------------------------- resource


class ObjectMeta(BaseModel):
    """The parts of metadata we read; the rest of what the API server sends is ignored."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, alias_generator=to_camel)

    name: str = Field(
        description="Name of the LLMDeployment.", pattern=DNS_LABEL, max_length=MAX_NAME_LENGTH
    )
    namespace: str = Field(default="default", description="Namespace.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations.")
    uid: str | None = Field(default=None, description="UID assigned by the API server.")
    generation: int | None = Field(
        default=None, description="Spec generation assigned by the API server."
    )


class LLMDeployment(ApiModel):
    """An LLMDeployment custom resource."""

    api_version: Literal["servefleet.io/v1alpha1"] = Field(
        default="servefleet.io/v1alpha1", description="servefleet.io/v1alpha1."
    )
    kind: Literal["LLMDeployment"] = Field(default="LLMDeployment", description="LLMDeployment.")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: LLMDeploymentSpec = Field(description="Desired state.")
    status: LLMDeploymentStatus = Field(
        default_factory=LLMDeploymentStatus, description="Observed state."
    )

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace


__all__ = [
    "API_GROUP",
    "API_VERSION",
    "FULL_API_VERSION",
    "KIND",
    "PLURAL",
    "SHORT_NAME",
    "AdmissionSpec",
    "AutoscalingSpec",
    "Condition",
    "EngineSpec",
    "EnvVar",
    "LLMDeployment",
    "LLMDeploymentSpec",
    "LLMDeploymentStatus",
    "ModelSource",
    "ModelSpec",
    "ObjectMeta",
    "PoolSpec",
    "PvcModelSource",
    "ResourceRequirements",
    "SecretKeyRef",
    "SpilloverSpec",
    "SpilloverWhen",
    "TenantLimits",
    "TenantSpec",
]
