"""Engine settings: one pydantic model behind the CLI flags and the operator's args.

Each field's default, description and bounds come from the knob table
(`servefleet.api.engine_flags`), which the CLI builds its flags from too; the field's type
is written here so the model stays typed (a test checks type and allowed values against
the table).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from servefleet.api.engine_flags import (
    BatchInvariantChoice,
    DecodeKernelChoice,
    MatmulChoice,
    ToolCallParser,
    WeightsDtype,
    engine_flag,
)
from servefleet.api.kv_cache import KVCacheDtype
from servefleet.api.load_quantization import LoadQuantization
from servefleet.api.matmul_dtype import MatmulDtype
from servefleet.api.quantity import parse_memory_size
from servefleet.api.replica_endpoints import IPNetwork, parse_networks
from servefleet.api.speculative import SpeculativeConfig
from servefleet.api.step_cost import DecodeStepTarget, parse_decode_step_target


def peer_networks(value: str) -> tuple[IPNetwork, ...]:
    """`--kv-peer-networks`: comma-separated CIDRs (empty: no peer may be pulled from)."""
    try:
        return tuple(parse_networks([part.strip() for part in value.split(",") if part.strip()]))
    except ValueError as exc:
        raise ValueError(f"--kv-peer-networks: {exc}") from exc


class EngineSettingsError(ValueError):
    """Settings that validate alone but not against the model or machine (a KV-cache
    budget under two blocks); reported in one line, not as a traceback."""


def knob(name: str, **extra: Any) -> Any:
    """The field of knob `name`: default, description and bounds from the table."""
    row = engine_flag(name)
    return Field(
        default=... if row.required else row.default,
        description=row.help,
        ge=row.minimum,
        gt=row.above,
        le=row.maximum,
        **extra,
    )


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = knob("model")
    served_model_name: str | None = knob("served_model_name")
    host: str = knob("host")
    port: int = knob("port")
    api_key: str | None = knob("api_key", repr=False)
    kv_peer_networks: str = knob("kv_peer_networks")
    kv_warm_start_seconds: float = knob("kv_warm_start_seconds")
    dtype: WeightsDtype = knob("dtype")
    device: str = knob("device")
    tool_call_parser: ToolCallParser | None = knob("tool_call_parser")
    enable_lora: bool = knob("enable_lora")
    max_loras: int = knob("max_loras")
    max_lora_rank: int = knob("max_lora_rank")
    max_lora_memory: str = knob("max_lora_memory")
    drain_timeout: float = knob("drain_timeout")
    stall_timeout: float = knob("stall_timeout")
    prepare_timeout: float = knob("prepare_timeout")
    block_size: int = knob("block_size")
    kv_cache_memory: str = knob("kv_cache_memory")
    kv_cache_dtype: KVCacheDtype = knob("kv_cache_dtype")
    max_num_seqs: int = knob("max_num_seqs")
    max_num_batched_tokens: int = knob("max_num_batched_tokens")
    max_decode_step_ms: str = knob("max_decode_step_ms")
    max_queue_depth: int = knob("max_queue_depth")
    max_model_len: int | None = knob("max_model_len")
    enable_prefix_caching: bool = knob("enable_prefix_caching")
    speculative_config: SpeculativeConfig | None = knob("speculative_config")
    decode_kernel: DecodeKernelChoice = knob("decode_kernel")
    matmul: MatmulChoice = knob("matmul")
    matmul_dtype: MatmulDtype = knob("matmul_dtype")
    batch_invariant: BatchInvariantChoice = knob("batch_invariant")
    packed_weights: bool = knob("packed_weights")
    quantization: LoadQuantization | None = knob("quantization")
    threads: int | None = knob("threads")
    tensor_parallel_size: int = knob("tensor_parallel_size")
    pipeline_parallel_size: int = knob("pipeline_parallel_size")
    pipeline_micro_batches: int = knob("pipeline_micro_batches")
    dist_timeout: float = knob("dist_timeout")

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative_json(cls, value: Any) -> Any:
        """The flag's value is a JSON string; the operator's args may pass the object."""
        if isinstance(value, str):
            return SpeculativeConfig.model_validate_json(value)
        return value

    @field_validator("kv_peer_networks")
    @classmethod
    def _peer_networks(cls, value: str) -> str:
        peer_networks(value)
        return value

    @property
    def peer_networks(self) -> tuple[IPNetwork, ...]:
        return peer_networks(self.kv_peer_networks)

    @field_validator("max_decode_step_ms")
    @classmethod
    def _decode_step_target(cls, value: str) -> str:
        parse_decode_step_target(value)
        return value

    @property
    def decode_step_target(self) -> DecodeStepTarget:
        return parse_decode_step_target(self.max_decode_step_ms)

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory(cls, value: str) -> str:
        parse_memory_size(value)  # the grammar engine.kvCacheMemory uses too
        return value

    @field_validator("max_lora_memory")
    @classmethod
    def _lora_memory(cls, value: str) -> str:
        if parse_memory_size(value).bytes is None:
            raise ValueError(f"--max-lora-memory {value}: a size (1GiB, 512MB), not a fraction")
        return value

    @property
    def lora_memory_bytes(self) -> int:
        size = parse_memory_size(self.max_lora_memory).bytes
        assert size is not None  # checked above
        return size

    @property
    def name(self) -> str:
        return self.served_model_name or self.model
