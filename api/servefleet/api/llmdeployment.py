"""The LLMDeployment resource: one pydantic model shared by the CRD, the operator,
the gateway and local mode, so the schema Kubernetes enforces and the one Python
validates can never disagree (the CRD is generated from these classes).

The spec's larger sections live in their own modules (`engine_spec`: the engine;
`model_source`: where weights come from and their cache; `traffic`: tenants and
spill-over; `deployment_status`: what the operator observed) on the common base in
`api_model`; this module re-exports them, so `servefleet.api.llmdeployment` names every
part of the resource.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from servefleet.api.api_model import DNS_LABEL, ApiModel, SecretKeyRef, cel_rule
from servefleet.api.budgets import COST_BUDGET_CEL, COST_BUDGET_MESSAGE, TokenPrices
from servefleet.api.cache_salt import PrefixCacheSharing
from servefleet.api.chargeback_spec import ChargebackSpec
from servefleet.api.deployment_status import Condition, LLMDeploymentStatus
from servefleet.api.disaggregation import (
    DisaggregationSpec,
    transfer_cel_rules,
    transfer_refusal,
)
from servefleet.api.engine_spec import Dtype, EngineKind, EngineSpec, EnvVar, ResourceRequirements
from servefleet.api.kv_warm import KVWarmStartSpec
from servefleet.api.load_quantization import LOAD_QUANTIZATIONS, LoadQuantization
from servefleet.api.model_source import (
    HostPathModelCache,
    HuggingFaceSource,
    ModelCache,
    ModelSource,
    OciImageSource,
    PvcModelCache,
    PvcModelSource,
    S3Source,
    cache_rule,
    check_cache,
)
from servefleet.api.prices_spec import HostedPrices, PricesSpec, merged
from servefleet.api.scaling_prices import RENT_OR_BUY_MESSAGE, ScalingPrices
from servefleet.api.scheduling import SchedulingSpec
from servefleet.api.traffic import (
    SpilloverSpec,
    SpilloverWhen,
    TenantLimits,
    TenantSpec,
    TrafficClass,
)

API_GROUP = "servefleet.io"

API_VERSION = "v1alpha1"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
SHORT_NAME = "llmd"
FULL_API_VERSION = f"{API_GROUP}/{API_VERSION}"

# Child objects get names like "<name>-engine-abcde": keep the CR name short enough.
MAX_NAME_LENGTH = 40


# --------------------------------------------------------------------------- model


Quantization = Literal["none", "q4_0", "q4_1", "q8_0", "awq", "gptq", "fp8", LoadQuantization]
VLLM_QUANTIZATIONS = ("awq", "gptq", "fp8")
"""Quantizations vLLM and SGLang load (passed as --quantization); GGUF files carry their own."""
QUANTIZATION_MESSAGE = (
    "model.quantization awq, gptq and fp8 need engine.kind vllm or sglang "
    "(servefleet reads the quantization its checkpoint carries: GGUF types, AWQ/GPTQ config.json)"
)
LOAD_QUANTIZATION_MESSAGE = (
    "model.quantization int8 and int4 (quantized at load) need engine.kind servefleet"
)


class ModelSpec(ApiModel):
    """The model this deployment serves."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cache_rule()]})

    name: str = Field(
        description="Model name clients send in the OpenAI 'model' field.",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
    )
    source: ModelSource = Field(description="Where the weights come from.")
    cache: ModelCache | None = Field(
        default=None,
        description="Where downloads are kept (url, huggingface, s3), so the second replica "
        "and every restart load from disk; unset = each pod downloads into an emptyDir.",
    )
    quantization: Quantization = Field(
        default="none",
        description="Weight quantization: awq, gptq and fp8 are passed to vLLM/SGLang as "
        "--quantization; int8 and int4 make servefleet quantize float weights at load; "
        "'none' and the GGUF kinds load weights as stored (GGUF carries its own).",
    )

    @model_validator(mode="after")
    def _cache_for_downloads(self) -> ModelSpec:
        check_cache(self.source, self.cache)
        return self


# --------------------------------------------------------------------------- pool and scaling


class PoolSpec(ApiModel):
    """Bounds of the replica pool; the desired count itself is `spec.replicas`."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
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
    prices: ScalingPrices | None = Field(
        default=None,
        description="Rent-or-buy, on when set: spill-over is weighed against new replicas at "
        "spec.prices (both needed).",
    )


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
    interactive_reserved_slots: int = Field(
        default=1,
        ge=0,
        le=1000,
        description=(
            "Slots of each replica (of pool.perReplicaConcurrency) that batch-class requests "
            "never take, so an interactive request finds one free instead of queueing behind "
            "batch work; at most perReplicaConcurrency - 1 apply (batch keeps one slot)."
        ),
    )


def batch_reserve(per_replica_concurrency: int, admission: AdmissionSpec) -> int:
    """Slots of each replica batch-class requests leave to interactive ones: the reserve,
    at most all but one (so a batch backlog always progresses). The gateway admits by it; the
    autoscaler sizes batch capacity by the rest."""
    return min(admission.interactive_reserved_slots, per_replica_concurrency - 1)


# --------------------------------------------------------------------------- spec

GROUP_DISAGGREGATION_MESSAGE = (
    "spec.disaggregation runs replicas of one pod: it needs engine.pipelineParallelSize 1 "
    "(and tensorParallelSize 1 for engine.kind servefleet)"
)


class LLMDeploymentSpec(ApiModel):
    """A warm pool of engine replicas serving one model behind the gateway."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "!has(self.spillover) || !has(self.spillover.tenants) || "
                    "self.spillover.tenants.all(t, has(self.tenants) "
                    "&& self.tenants.exists(x, x.name == t))",
                    "spillover.tenants must name tenants listed in spec.tenants",
                ),
                cel_rule(
                    "self.engine.kind == 'servefleet' || !has(self.model.source.builtin)",
                    "model.source.builtin models run only on engine.kind servefleet",
                ),
                cel_rule(
                    "self.engine.kind != 'servefleet' || "
                    "!(self.model.quantization in ['awq', 'gptq', 'fp8'])",
                    QUANTIZATION_MESSAGE,
                ),
                cel_rule(
                    "self.engine.kind == 'servefleet' || "
                    "!(self.model.quantization in ['int8', 'int4'])",
                    LOAD_QUANTIZATION_MESSAGE,
                ),
                *transfer_cel_rules(),
                cel_rule(
                    "!has(self.disaggregation) || (self.engine.pipelineParallelSize == 1 && "
                    "(self.engine.kind != 'servefleet' || self.engine.tensorParallelSize == 1))",
                    GROUP_DISAGGREGATION_MESSAGE,
                ),
                cel_rule(COST_BUDGET_CEL, COST_BUDGET_MESSAGE),
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
        "Unset means pool.minReplicas. A value outside [pool.minReplicas, pool.maxReplicas] is "
        "clamped, as HPA does, and reported by the ScalingLimited condition.",
    )
    pool: PoolSpec = Field(default_factory=PoolSpec, description="Bounds of the replica pool.")
    autoscaling: AutoscalingSpec = Field(
        default_factory=AutoscalingSpec, description="Queue-depth autoscaling."
    )
    admission: AdmissionSpec = Field(
        default_factory=AdmissionSpec, description="The gateway's bounded queue."
    )
    prefix_cache_sharing: PrefixCacheSharing = Field(
        default="tenant",
        description="Who shares the engines' prefix cache: tenant (each tenant only its own "
        "prefixes, the gateway salts every request with its tenant) or deployment (every "
        "tenant of this deployment: more hits, but a tenant can learn from cached_tokens or "
        "timing which prefixes another sent). A request's own cache_salt splits it further.",
    )
    kv_warm_start: KVWarmStartSpec = Field(
        default_factory=KVWarmStartSpec,
        description="Scale-up warm start (servefleet engines, prefix cache on): a new replica "
        "pulls its ready peers' hottest prefixes before it reports ready.",
    )
    tenants: list[TenantSpec] = Field(
        default_factory=list,
        max_length=100,
        description="Tenants allowed to call this model, keys by Secret reference.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    spillover: SpilloverSpec | None = Field(default=None, description="Overflow to a hosted API.")
    chargeback: ChargebackSpec | None = Field(
        default=None,
        description="Who pays for idle replicas in the usage report (`servefleet usage`, "
        "priced by spec.prices); unset: idle is the platform's.",
    )
    prices: PricesSpec | None = Field(
        default=None,
        description="What a replica-hour and the hosted API's tokens cost (one currency): the "
        "one definition the autoscaler's rent-or-buy and the usage report read. Not "
        "tokenPrices (what tenants are charged).",
    )
    scheduling: SchedulingSpec = Field(
        default_factory=SchedulingSpec, description="Where engine pods run."
    )
    disaggregation: DisaggregationSpec | None = Field(
        default=None,
        description="Separate prefill and decode pools (the deployment's pool decodes); "
        "unset: each replica prefills and decodes (colocated).",
    )
    token_prices: TokenPrices | None = Field(
        default=None,
        description="USD per million prompt / completion tokens of this model: what a "
        "tenant's cost budget is charged for each request here.",
    )

    @model_validator(mode="after")
    def _cross_field(self) -> LLMDeploymentSpec:
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
        if self.engine.kind == "servefleet" and self.model.quantization in VLLM_QUANTIZATIONS:
            raise ValueError(QUANTIZATION_MESSAGE)
        if self.engine.kind != "servefleet" and self.model.quantization in LOAD_QUANTIZATIONS:
            raise ValueError(LOAD_QUANTIZATION_MESSAGE)
        if refused := transfer_refusal(self.engine.kind, self.disaggregation):
            raise ValueError(refused)
        engine = self.engine
        if self.disaggregation is not None and (
            engine.pipeline_parallel_size != 1
            or (engine.kind == "servefleet" and engine.tensor_parallel_size != 1)
        ):
            raise ValueError(GROUP_DISAGGREGATION_MESSAGE)
        if self.token_prices is None and any(
            t.limits.has_cost_budget
            or (t.model_limits is not None and t.model_limits.has_cost_budget)
            for t in self.tenants
        ):
            raise ValueError(COST_BUDGET_MESSAGE)
        return self

    @model_validator(mode="after")
    def _one_price_each(self) -> LLMDeploymentSpec:
        """spec.prices, with the deprecated spellings of its prices mapped in."""
        scaling, charge = self.autoscaling.prices, self.chargeback
        spill = scaling.spill_per_million_tokens if scaling else None
        flat = HostedPrices(input_per_million=spill, output_per_million=spill) if spill else None
        self.prices = merged(
            self.prices,
            [
                ("spec.chargeback.replicaHour", charge.replica_hour if charge else None),
                ("spec.chargeback.hosted", charge.hosted if charge else None),
                ("spec.autoscaling.prices.replicaHour", scaling.replica_hour if scaling else None),
                ("spec.autoscaling.prices.spillPerMillionTokens", flat),
            ],
        )
        if scaling is not None and (
            self.prices is None or self.prices.replica_hour is None or self.prices.hosted is None
        ):
            raise ValueError(RENT_OR_BUY_MESSAGE)
        return self

    def desired_replicas(self) -> int:
        """Replicas to run now: spec.replicas, else the warm minimum, clamped to the pool.

        Clamped rather than refused: a GitOps re-apply that lowers maxReplicas after the
        autoscaler scaled up must not be rejected (HPA clamps the same way).
        """
        wanted = self.pool.min_replicas if self.replicas is None else self.replicas
        return max(self.pool.min_replicas, min(self.pool.max_replicas, wanted))

    def replicas_limit(self) -> str | None:
        """Why spec.replicas is not what runs ("above pool.maxReplicas 3"), or None."""
        if self.replicas is None or self.replicas == self.desired_replicas():
            return None
        if self.replicas > self.pool.max_replicas:
            return (
                f"spec.replicas {self.replicas} is above pool.maxReplicas {self.pool.max_replicas}"
            )
        return f"spec.replicas {self.replicas} is below pool.minReplicas {self.pool.min_replicas}"


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
    resource_version: str | None = Field(
        default=None, description="The version read (for writes that must not race another)."
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
    "DNS_LABEL",
    "FULL_API_VERSION",
    "KIND",
    "MAX_NAME_LENGTH",
    "PLURAL",
    "SHORT_NAME",
    "AdmissionSpec",
    "AutoscalingSpec",
    "Condition",
    "Dtype",
    "EngineKind",
    "EngineSpec",
    "EnvVar",
    "HostPathModelCache",
    "HuggingFaceSource",
    "LLMDeployment",
    "LLMDeploymentSpec",
    "LLMDeploymentStatus",
    "ModelCache",
    "ModelSource",
    "ModelSpec",
    "ObjectMeta",
    "OciImageSource",
    "PoolSpec",
    "PvcModelCache",
    "PvcModelSource",
    "ResourceRequirements",
    "S3Source",
    "ScalingPrices",
    "SchedulingSpec",
    "SecretKeyRef",
    "SpilloverSpec",
    "SpilloverWhen",
    "TenantLimits",
    "TenantSpec",
    "TrafficClass",
]
