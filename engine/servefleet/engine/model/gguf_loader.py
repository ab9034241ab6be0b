"""GGUF weights -> float32 tensors in Hugging Face naming.

Dequantization goes through `gguf.quants.dequantize`, so every type the `gguf` package
knows (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants, ...) works without our own bit
twiddling. llama.cpp stores the q/k projections of llama-architecture models permuted for
its interleaved rope layout; they are permuted back here so one model code path serves
both GGUF and safetensors checkpoints.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from servefleet.engine.kernels.packed_weights import BlockQuantized
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.gguf_blocks import GGUF_PACKED_TYPES, from_gguf_blocks

# Architectures whose GGUF converter permutes q/k for llama.cpp's rope.
_PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_PATTERN = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors llama.cpp writes that carry no weights for us (rope_freqs is folded into the config).
_IGNORED = frozenset({"rope_freqs.weight"})


class GGUFLoadError(ValueError):
    """The GGUF file holds something this loader cannot turn into model weights."""


def open_gguf(path: str | Path) -> GGUFReader:
    try:
        return GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise GGUFLoadError(f"cannot read GGUF file {path}: {exc}") from exc


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name for a GGUF tensor name; None for tensors we skip."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _IGNORED:
        return None
    match = _LAYER_PATTERN.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise GGUFLoadError(f"unexpected tensor {gguf_name!r} in GGUF file")
    index, part, kind = match.groups()
    return f"model.layers.{index}.{_LAYER_NAMES[part]}.{kind}"


def dequantize_tensor(
    data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Raw GGUF tensor data -> float32 tensor of `shape` (rows-major, HF order)."""
    try:
        values = dequantize(data, qtype)
    except NotImplementedError as exc:
        raise GGUFLoadError(f"GGUF tensor type {qtype.name} is not supported: {exc}") from exc
    array = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
    if not array.flags.writeable:  # F32 tensors come straight from the read-only file map
        array = array.copy()
    return torch.from_numpy(array)


def unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of q/k rows (interleaved pairs -> rotate_half halves)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


def read_gguf_weights(
    reader: GGUFReader,
    config: ModelConfig,
    on_tensor: Callable[[], None] | None = None,
    skip: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """Every model tensor of the file but those named in `skip`, dequantized to float32,
    under HF names; `on_tensor` is called after each tensor of the file (progress)."""
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    permuted = arch in _PERMUTED_ARCHITECTURES
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if on_tensor is not None:
            on_tensor()
        name = hf_name(tensor.name)
        if name is None or name in skip:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        value = dequantize_tensor(tensor.data, tensor.tensor_type, shape)
        if permuted and ".self_attn.q_proj." in name:
            value = unpermute_rope(value, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            value = unpermute_rope(value, config.num_kv_heads)
        weights[name] = value
    return weights


class GGUFBlocks(Mapping[str, BlockQuantized]):
    """The 2-D tensors stored in a packable block format (`GGUF_PACKED_TYPES`), by HF
    name, parsed when read (one at a time: the integers take a byte a weight), with q/k
    rows un-permuted like `read_gguf_weights`."""

    def __init__(self, reader: GGUFReader, config: ModelConfig) -> None:
        field = reader.fields.get("general.architecture")
        self._permuted = (field.contents() if field is not None else None) in (
            _PERMUTED_ARCHITECTURES
        )
        self._config = config
        self.on_tensor: Callable[[], None] | None = None  # called for each tensor parsed
        self._tensors: dict[str, ReaderTensor] = {}
        for tensor in reader.tensors:
            name = hf_name(tensor.name)
            packable = tensor.tensor_type.name in GGUF_PACKED_TYPES and len(tensor.shape) == 2
            if name is not None and packable:
                self._tensors[name] = tensor

    def __getitem__(self, name: str) -> BlockQuantized:
        tensor = self._tensors[name]
        if self.on_tensor is not None:
            self.on_tensor()
        cols, rows = (int(d) for d in tensor.shape.tolist())
        weight = from_gguf_blocks(tensor.tensor_type.name, tensor.data, rows, cols)
        heads = None
        if self._permuted and ".self_attn.q_proj." in name:
            heads = self._config.num_heads
        elif self._permuted and ".self_attn.k_proj." in name:
            heads = self._config.num_kv_heads
        if heads is not None:
            order = unpermute_rope(torch.arange(rows), heads).numpy()
            weight = weight.permute_rows(order)
        return weight

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def rope_freq_factors(reader: GGUFReader) -> tuple[float, ...] | None:
    """The `rope_freqs.weight` divisors llama.cpp writes for Llama 3.1-style rope scaling."""
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            values = dequantize_tensor(tensor.data, tensor.tensor_type, (-1,))
            return tuple(float(v) for v in values.tolist())
    return None


def config_from_gguf(reader: GGUFReader) -> ModelConfig:
    """ModelConfig from metadata, with rope frequency factors from the tensor when present."""
    config = ModelConfig.from_gguf(reader)
    factors = rope_freq_factors(reader)
    if factors is not None:
        config = config.model_copy(update={"rope_freq_factors": factors})
    return config
