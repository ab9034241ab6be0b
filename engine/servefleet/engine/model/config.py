"""The model's shape, read from a Hugging Face `config.json` or from GGUF metadata.

One pydantic model for both sources, so the rest of the engine never cares where the
weights came from. Unknown fields in HF configs are ignored; missing required ones fail
loudly with the key that was expected.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

Architecture = Literal["llama", "qwen2", "mistral"]
RopeType = Literal["linear", "llama3", "yarn", "dynamic"]

_HF_ARCHITECTURES: dict[str, Architecture] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "mistral": "mistral",
}
_GGUF_ARCHITECTURES: dict[str, Architecture] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "mistral": "mistral",
}


class ModelConfigError(ValueError):
    """The config describes a model this engine cannot run."""


class RopeScaling(BaseModel):
    """The subset of HF's `rope_scaling` / `rope_parameters` the supported variants read."""

    model_config = ConfigDict(frozen=True)

    rope_type: RopeType
    factor: float = 1.0
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


class ModelConfig(BaseModel):
    """Everything the Llama-family module needs to build itself."""

    model_config = ConfigDict(frozen=True)

    architecture: Architecture
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors some GGUF files store as `rope_freqs.weight` (llama.cpp's way of
    # writing Llama 3.1 rope scaling); applied on top of the base frequencies.
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v
    output_bias: bool = False  # bias on o_proj (Llama's `attention_bias` covers it; Qwen2's not)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = Field(default_factory=list)
    # Recorded, not enforced: attention runs over the full context.
    sliding_window: int | None = None

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        return self

    @classmethod
    def from_hf_config(
        cls, hf: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from a parsed `config.json` (old `rope_scaling` or new `rope_parameters` form)."""
        model_type = hf.get("model_type")
        if model_type not in _HF_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r}; supported: {sorted(_HF_ARCHITECTURES)}"
            )
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            layers = int(hf["num_hidden_layers"])
            intermediate = int(hf["intermediate_size"])
            vocab = int(hf["vocab_size"])
        except KeyError as exc:
            raise ModelConfigError(f"config.json lacks required key {exc.args[0]!r}") from exc
        if hf.get("mlp_bias"):
            raise ModelConfigError("mlp_bias=true is not supported")
        rope_theta, rope_scaling = _hf_rope(hf)
        llama_bias = model_type == "llama" and bool(hf.get("attention_bias", False))
        eos = _as_id_list(hf.get("eos_token_id"))
        if generation_config:
            eos += [i for i in _as_id_list(generation_config.get("eos_token_id")) if i not in eos]
        return cls(
            architecture=_HF_ARCHITECTURES[model_type],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always carries q/k/v bias; its config has no flag for it.
            attention_bias=model_type == "qwen2" or llama_bias,
            output_bias=llama_bias,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True) else None,
        )

    @classmethod
    def from_gguf(cls, reader: GGUFMetadata) -> ModelConfig:
        """Build from a `gguf.GGUFReader` (only `fields` and `tensors` are read)."""
        fields = reader.fields

        def get(key: str, default: Any = None) -> Any:
            field = fields.get(key)
            return default if field is None else field.contents()

        arch_name = get("general.architecture")
        if arch_name not in _GGUF_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported GGUF architecture {arch_name!r}; supported: "
                f"{sorted(_GGUF_ARCHITECTURES)}"
            )

        def need(key: str) -> Any:
            value = get(f"{arch_name}.{key}")
            if value is None:
                raise ModelConfigError(f"GGUF metadata lacks {arch_name}.{key}")
            return value

        tensor_names = {t.name for t in reader.tensors}
        hidden = int(need("embedding_length"))
        heads = int(need("attention.head_count"))
        kv_heads = get(f"{arch_name}.attention.head_count_kv", heads)
        head_dim = get(f"{arch_name}.attention.key_length") or get(
            f"{arch_name}.rope.dimension_count"
        )
        vocab = get(f"{arch_name}.vocab_size")
        if vocab is None:
            tokens = fields.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ModelConfigError("GGUF metadata gives neither vocab_size nor tokens")
            vocab = len(tokens.data)
        eos: list[int] = []
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
            value = get(key)
            if value is not None and int(value) not in eos:
                eos.append(int(value))
        bos = get("tokenizer.ggml.bos_token_id")
        return cls(
            architecture=_GGUF_ARCHITECTURES[arch_name],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim or hidden // heads),
            rms_norm_eps=float(get(f"{arch_name}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get(f"{arch_name}.rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope(get, arch_name),
            max_position_embeddings=int(get(f"{arch_name}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            output_bias="blk.0.attn_output.bias" in tensor_names,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
            sliding_window=get(f"{arch_name}.attention.sliding_window"),
        )


class GGUFMetadata(Protocol):
    """What `ModelConfig.from_gguf` reads from a `gguf.GGUFReader`."""

    @property
    def fields(self) -> Any: ...

    @property
    def tensors(self) -> Any: ...


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def _hf_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """HF moved rope settings from `rope_theta`/`rope_scaling` to `rope_parameters`; read both."""
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    merged = {**legacy, **params}
    theta = float(merged.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in ("linear", "llama3", "yarn", "dynamic"):
        raise ModelConfigError(
            f"unsupported rope scaling {rope_type!r}; supported: linear, llama3, yarn, dynamic"
        )
    keys = set(RopeScaling.model_fields) - {"rope_type"}
    scaling = {k: v for k, v in merged.items() if k in keys and v is not None}
    if rope_type in ("llama3", "yarn"):
        scaling.setdefault(
            "original_max_position_embeddings",
            hf.get("original_max_position_embeddings", hf.get("max_position_embeddings")),
        )
    return theta, RopeScaling(rope_type=rope_type, **scaling)


def _gguf_rope(get: Any, arch: str) -> RopeScaling | None:
    kind = get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(get(f"{arch}.rope.scaling.factor", 1.0))
    original = get(f"{arch}.rope.scaling.original_context_length")
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=factor)
    if kind == "yarn":
        return RopeScaling(
            rope_type="yarn",
            factor=factor,
            original_max_position_embeddings=None if original is None else int(original),
        )
    raise ModelConfigError(f"unsupported GGUF rope scaling type {kind!r}")
