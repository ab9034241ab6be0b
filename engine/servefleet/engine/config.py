"""Engine settings: one pydantic model behind the CLI flags and the operator's args."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from servefleet.api.kv_cache import KVCacheDtype
from servefleet.api.load_quantization import LoadQuantization
from servefleet.api.matmul_dtype import MatmulDtype
from servefleet.api.quantity import parse_memory_size
from servefleet.api.speculative import SpeculativeConfig


class EngineSettingsError(ValueError):
    """Settings that validate alone but not against the model or machine (a KV-cache
    budget under two blocks); reported in one line, not as a traceback."""


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="GGUF file, Hugging Face folder, or built-in model name.")
    served_model_name: str | None = Field(default=None, description="Name clients ask for.")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    device: str = "auto"
    block_size: int = Field(default=16, ge=1, le=256)
    kv_cache_memory: str = Field(
        default="384MiB",
        description="Most bytes the KV cache reserves (it holds what max_num_seqs x "
        "max_model_len needs, up to this), or a fraction of free memory.",
    )
    kv_cache_dtype: KVCacheDtype = Field(
        default="auto",
        description="auto: the model's dtype; float16 halves attention reads, not batch-invariant; "
        "int8: quantized rows with a per-token scale, ~3.8x the tokens of float32 (not Triton).",
    )
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=512, ge=1)
    max_queue_depth: int = Field(default=256, ge=0)
    max_model_len: int | None = Field(default=None, ge=16)
    enable_prefix_caching: bool = True
    drain_timeout: float = Field(default=30.0, ge=0)
    stall_timeout: float = Field(default=120.0, gt=0)
    prepare_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Seconds one request may spend being prepared (chat template, tokens, "
        "grammar compile) before it is refused as too complex (400 request_too_complex).",
    )
    decode_kernel: Literal["auto", "torch", "cpu-c", "triton"] = "auto"
    matmul: Literal["auto", "torch", "cpu-c"] = Field(
        default="auto", description="Projection matmuls: auto = C few-row kernels on CPU."
    )
    matmul_dtype: MatmulDtype = Field(
        default="float32",
        description="bfloat16: projection calls of 8+ rows (prompt chunks, decode steps of 8+ "
        "sequences) multiply bfloat16-rounded x and W, summed in float32; fast where the CPU has "
        "AVX512_BF16 or AMX; a float32 model on CPU with the C matmuls only; not batch-invariant.",
    )
    packed_weights: bool = Field(
        default=True,
        description="Decode matmuls read a quantized checkpoint's 4/8-bit blocks (CPU, float32).",
    )
    quantization: LoadQuantization | None = Field(
        default=None,
        description="Quantize a float checkpoint's projections at load to packed int8 or int4 "
        "blocks (CPU, float32, packed weights on); None: weights as stored.",
    )
    threads: int | None = Field(default=None, ge=1)
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        default=None,
        description="How `tool_choice: auto` reads the model's tool calls (None: from the chat "
        "template).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    api_key: str | None = Field(
        default=None,
        repr=False,
        description="Bearer key every path but /health, /ready, /metrics and /version "
        "requires (None: open, as vLLM without --api-key).",
    )

    speculative_config: SpeculativeConfig | None = Field(
        default=None,
        description="Speculative decoding, vLLM's JSON (`--speculative-config`); None: off.",
    )

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative_json(cls, value: Any) -> Any:
        """The flag's value is a JSON string; the operator's args may pass the object."""
        if isinstance(value, str):
            return SpeculativeConfig.model_validate_json(value)
        return value

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory(cls, value: str) -> str:
        parse_memory_size(value)  # the grammar engine.kvCacheMemory uses too
        return value

    @property
    def name(self) -> str:
        return self.served_model_name or self.model
