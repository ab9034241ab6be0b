"""Checkpoint tensors in Hugging Face naming -> the decoder's state dict and packed weights.

Every loader yields HF names (`model.layers.N.self_attn.q_proj.weight`); this module fuses
them into `LlamaForCausalLM`'s layout (q/k/v and gate/up concatenated, projections stored
[in, out]) so loaders never know the module and the module never knows file formats.
A projection a quantized checkpoint stores in a packed format is fused from its blocks
instead and never exists as float32 (`packed_sources` says which HF tensors that covers).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping

import torch

from servefleet.engine.kernels.matmul import dense_weight
from servefleet.engine.kernels.packed_weights import (
    BlockQuantized,
    PackedWeight,
    PackingError,
    pack,
)
from servefleet.engine.model.config import ModelConfig

LM_HEAD = "lm_head"  # the packed lm_head's name (the tied embedding's when they are tied)
PROJECTIONS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


class MissingWeightError(KeyError):
    """A checkpoint lacks a tensor the model needs."""


def _hf_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Our projection names (and the lm_head) -> the HF tensors fused into each."""
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    sources = {LM_HEAD: [head]}
    for index in range(config.num_layers):
        hf, ours = f"model.layers.{index}.", f"layers.{index}."
        sources[ours + "qkv_weight"] = [f"{hf}self_attn.{p}_proj.weight" for p in "qkv"]
        sources[ours + "o_weight"] = [hf + "self_attn.o_proj.weight"]
        sources[ours + "gate_up_weight"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        sources[ours + "down_weight"] = [hf + "mlp.down_proj.weight"]
    return sources


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(k, n) of every weight that may be packed: W [in, out] (the lm_head: [hidden, vocab])."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_width = config.num_heads * config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    shapes = {LM_HEAD: (hidden, config.vocab_size)}
    for index in range(config.num_layers):
        ours = f"layers.{index}."
        shapes[ours + "qkv_weight"] = (hidden, qkv)
        shapes[ours + "o_weight"] = (q_width, hidden)
        shapes[ours + "gate_up_weight"] = (hidden, 2 * inter)
        shapes[ours + "down_weight"] = (inter, hidden)
    return shapes


def packed_sources(config: ModelConfig, packed: Collection[str]) -> frozenset[str]:
    """The HF tensors that packed weights replace (never dequantized to float32). A tied
    embedding stays: the embedding lookup reads it."""
    sources = _hf_sources(config)
    names = {hf for ours in packed if ours != LM_HEAD for hf in sources[ours]}
    if LM_HEAD in packed and not config.tie_word_embeddings:
        names.add("lm_head.weight")
    return frozenset(names)


def fuse_hf_weights(
    config: ModelConfig, weights: Mapping[str, torch.Tensor], packed: Collection[str] = ()
) -> dict[str, torch.Tensor]:
    """HF-named tensors -> this module's state dict (q/k/v and gate/up concatenated),
    without the weights named in `packed` (they come packed instead).

    Projection weights come out transposed to [in, out] and contiguous (see DecoderLayer).
    """

    def take(name: str) -> torch.Tensor:
        tensor = weights.get(name)
        if tensor is None:
            raise MissingWeightError(f"checkpoint lacks tensor {name!r}")
        return tensor

    state = {"embed_tokens": take("model.embed_tokens.weight"), "norm": take("model.norm.weight")}
    if not config.tie_word_embeddings and LM_HEAD not in packed:
        state["lm_head"] = take("lm_head.weight")
    sources = _hf_sources(config)
    for index in range(config.num_layers):
        hf, ours = f"model.layers.{index}.", f"layers.{index}."
        state[ours + "input_norm"] = take(hf + "input_layernorm.weight")
        state[ours + "post_attn_norm"] = take(hf + "post_attention_layernorm.weight")
        for name in PROJECTIONS:
            if ours + name not in packed:
                state[ours + name] = _in_out(torch.cat([take(n) for n in sources[ours + name]]))
        if config.attention_bias:
            state[ours + "qkv_bias"] = torch.cat(
                [take(f"{hf}self_attn.{p}_proj.bias") for p in "qkv"]
            )
        if config.output_bias:
            state[ours + "o_bias"] = take(hf + "self_attn.o_proj.bias")
    return state


def fuse_packed_weights(
    config: ModelConfig, quantized: Mapping[str, BlockQuantized]
) -> dict[str, PackedWeight]:
    """Block-quantized HF tensors -> packed forms under this module's parameter names.

    A fused projection is packed when all its parts are block-quantized (in one format,
    or in formats that change only at a 16-row boundary); `quantized` may parse lazily,
    each tensor is read once.
    """
    packed: dict[str, PackedWeight] = {}
    for ours, names in _hf_sources(config).items():
        if not all(n in quantized for n in names):
            continue
        try:
            packed[ours] = pack([quantized[n] for n in names])
        except PackingError:
            continue  # stays float32
    return packed


class FusedProjections(Mapping[str, torch.Tensor]):
    """HF-named tensors seen under the fused names quantizing at load looks up (each
    projection as `fuse_hf_weights` makes it, `embed_tokens`, `lm_head`), fused only when
    looked up: with `hf` reading from disk, one projection's parts exist at a time."""

    def __init__(self, config: ModelConfig, hf: Mapping[str, torch.Tensor]) -> None:
        self._hf = hf
        self._sources = {n: s for n, s in _hf_sources(config).items() if n != LM_HEAD}
        self._sources |= {"embed_tokens": ["model.embed_tokens.weight"]}
        self._sources |= {"lm_head": ["lm_head.weight"]}

    def __getitem__(self, name: str) -> torch.Tensor:
        parts = [self._hf[n] for n in self._sources[name]]  # KeyError: absent
        if name in ("embed_tokens", "lm_head"):
            return parts[0]
        return torch.cat(parts).t()  # [in, out] like _in_out, without its copy

    def __iter__(self) -> Iterator[str]:
        return (n for n, s in self._sources.items() if all(p in self._hf for p in s))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def dense_from_packed(
    config: ModelConfig, packed: Mapping[str, PackedWeight]
) -> dict[str, torch.Tensor]:
    """State-dict entries for packed weights a model will hold as float32 instead (not a
    float32 CPU model, or packed weights turned off): their exact dequantization."""
    state: dict[str, torch.Tensor] = {}
    for name, weight in packed.items():
        if name != LM_HEAD:
            state[name] = dense_weight(weight)
        elif not config.tie_word_embeddings:
            state["lm_head"] = dense_weight(weight).t().contiguous()
    return state


def _in_out(weight_out_in: torch.Tensor) -> torch.Tensor:
    return weight_out_in.t().contiguous()
