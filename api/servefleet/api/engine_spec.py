"""`spec.engine`: the inference engine each replica runs, and its container."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from servefleet.api.api_model import QUANTITY, ApiModel, Quantity, SecretKeyRef, cel_rule
from servefleet.api.lora_spec import LoraSpec
from servefleet.api.parallel import (
    MAX_PODS_PER_REPLICA,
    OURS_ONE_GPU_MESSAGE,
    OURS_TOO_MANY_MESSAGE,
    STAGE_PER_POD_MESSAGE,
    TP_GPUS_MESSAGE,
    group_refusal,
    pods_per_replica,
)
from servefleet.api.quantity import MemorySize, parse_memory_size
from servefleet.api.speculative_spec import SpeculativeSpec

EngineKind = Literal["servefleet", "vllm", "sglang"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class EnvVar(ApiModel):
    """An environment variable for the engine container."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
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
        raw = self.limits.get(GPU_RESOURCE, self.requests.get(GPU_RESOURCE, 0))
        return int(raw)


GPU_RESOURCE = "nvidia.com/gpu"
# The CEL twin of ResourceRequirements.gpus(); int-or-string reads as a string either way.
_CEL_GPUS = (
    "(has(self.resources.limits) && 'nvidia.com/gpu' in self.resources.limits ? "
    "int(string(self.resources.limits['nvidia.com/gpu'])) : "
    "has(self.resources.requests) && 'nvidia.com/gpu' in self.resources.requests ? "
    "int(string(self.resources.requests['nvidia.com/gpu'])) : 0)"
)
SPECULATIVE_KIND_MESSAGE = "engine.speculative needs engine.kind servefleet or vllm"
SPECULATIVE_OURS_MESSAGE = (
    "engine.speculative.minAcceptanceRate is read by engine.kind servefleet only"
)
_CEL_RANKS = "self.tensorParallelSize * self.pipelineParallelSize"


class EngineSpec(ApiModel):
    """The inference engine running each replica."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "self.kind != 'servefleet' || self.dtype != 'float16'",
                    "engine.kind servefleet supports dtype auto, float32 or bfloat16",
                ),
                # `parallel.group_refusal`, rule for rule.
                cel_rule(
                    f"self.kind == 'servefleet' || self.tensorParallelSize <= 1 "
                    f"|| self.tensorParallelSize <= {_CEL_GPUS}",
                    TP_GPUS_MESSAGE,
                ),
                cel_rule(
                    f"self.kind == 'servefleet' || {_CEL_RANKS} <= 1 || {_CEL_RANKS} <= "
                    f"{_CEL_GPUS} || self.tensorParallelSize == {_CEL_GPUS}",
                    STAGE_PER_POD_MESSAGE,
                ),
                cel_rule(
                    f"self.kind != 'servefleet' || {_CEL_RANKS} <= 1 || {_CEL_GPUS} <= 1",
                    OURS_ONE_GPU_MESSAGE,
                ),
                cel_rule(
                    f"self.kind != 'servefleet' || {_CEL_RANKS} <= {MAX_PODS_PER_REPLICA}",
                    OURS_TOO_MANY_MESSAGE,
                ),
                cel_rule(
                    "self.kind != 'sglang' || !has(self.speculative)",
                    SPECULATIVE_KIND_MESSAGE,
                ),
                cel_rule(
                    "self.kind == 'servefleet' || !has(self.speculative) "
                    "|| !has(self.speculative.minAcceptanceRate)",
                    SPECULATIVE_OURS_MESSAGE,
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
        description="Ways each layer is sharded (vLLM's --tensor-parallel-size): GPUs of one "
        "pod for vllm/sglang; for servefleet, ranks over torch.distributed (gloo on CPU, NCCL "
        "on GPUs), one per pod. See pipelineParallelSize.",
    )
    pipeline_parallel_size: int = Field(
        default=1,
        ge=1,
        le=MAX_PODS_PER_REPLICA,
        description="Pipeline stages (vLLM's --pipeline-parallel-size). When tensorParallelSize "
        "x pipelineParallelSize exceeds one pod's GPUs, a replica is a group of pods (a "
        "LeaderWorkerSet): vllm/sglang one stage per pod (tensorParallelSize = the pod's "
        "GPUs), servefleet one rank per pod.",
    )
    block_size: int = Field(default=16, ge=1, le=1024, description="Tokens per KV-cache block.")
    kv_cache_memory: int | str | None = Field(
        default=None,
        description="KV-cache size: bytes (int), a fraction of free memory ('0.9'), or a size "
        "('4Gi', '512MB').",
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
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        description="Context length cap in tokens, prompt plus completion (engine default: "
        "the model's).",
    )
    speculative: SpeculativeSpec | None = Field(
        default=None,
        description="Speculative decoding (servefleet and vllm: --speculative-config); unset: off.",
    )
    lora: LoraSpec | None = Field(
        default=None,
        description="LoRA adapters (LLMAdapter resources naming this deployment): adapter "
        "slots and the largest rank per replica; unset: adapters are refused.",
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Key engine pods require from callers (the gateway sends it); unset: the "
        "operator creates a Secret '<name>-engine-key' holding a random one.",
    )

    @field_validator("kv_cache_memory")
    @classmethod
    def _kv_cache_memory(cls, value: int | str | None) -> int | str | None:
        if value is not None:
            try:
                parse_memory_size(value)
            except ValueError as exc:
                raise ValueError(f"engine.kvCacheMemory: {exc}") from None
        return value

    def pods_per_replica(self) -> int:
        """Pods one replica spans (`parallel`): more than one makes it a LeaderWorkerSet group."""
        return pods_per_replica(
            self.kind, self.tensor_parallel_size, self.pipeline_parallel_size, self.resources.gpus()
        )

    def kv_cache_size(self) -> MemorySize | None:
        """kvCacheMemory read with the engine's own grammar (None: the engine's default)."""
        return None if self.kv_cache_memory is None else parse_memory_size(self.kv_cache_memory)

    @model_validator(mode="after")
    def _engine_rules(self) -> EngineSpec:
        if self.kind == "servefleet" and self.dtype == "float16":
            raise ValueError("engine.kind servefleet supports dtype auto, float32 or bfloat16")
        if refused := group_refusal(
            self.kind, self.tensor_parallel_size, self.pipeline_parallel_size, self.resources.gpus()
        ):
            raise ValueError(refused)
        if self.speculative is not None and self.kind == "sglang":
            raise ValueError(SPECULATIVE_KIND_MESSAGE)
        speculative = self.speculative
        if (
            speculative
            and speculative.min_acceptance_rate is not None
            and self.kind != "servefleet"
        ):
            raise ValueError(SPECULATIVE_OURS_MESSAGE)
        return self
