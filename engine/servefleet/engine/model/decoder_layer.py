"""One decoder layer of the Llama family (`llama.LlamaForCausalLM` stacks them): fused
q/k/v and gate/up projections held as float32 [in, out] or packed blocks, RoPE, paged
attention, and the tensor-parallel all-reduce of o's and down's partial sums (`reduce`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servefleet.engine.attention import AttentionMetadata, PagedAttention
from servefleet.engine.kernels.cpu_fused_ops import CpuFusedOps
from servefleet.engine.kernels.lora_layout import LoraKernel
from servefleet.engine.kernels.matmul import TORCH_MATMUL, Matmul
from servefleet.engine.kernels.packed_weights import PackedWeight
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.kv_layout import KVCache

Reduce = Callable[[torch.Tensor], torch.Tensor]


def parameter(*shape: int, factory: dict[str, Any], fill: float | None = None) -> nn.Parameter:
    tensor = torch.empty(*shape, **factory) if fill is None else torch.full(shape, fill, **factory)
    return nn.Parameter(tensor, requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attn_impl: PagedAttention,
        factory: dict[str, Any],
        index: int = 0,
    ) -> None:
        super().__init__()
        self.index = index  # which layer of an adapter's weights apply here
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5
        self.attn_impl = attn_impl
        self.matmul: Matmul = TORCH_MATMUL
        self.lora_kernel: LoraKernel | None = None  # None: adapters' products in PyTorch
        self.reduce: Reduce = whole  # tensor parallel: the all-reduce of o's and down's partials
        hidden = config.hidden_size
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.input_norm = parameter(hidden, factory=factory, fill=1.0)
        # Projection weights are stored [in, out]: `x @ w` on that layout is markedly faster
        # than F.linear on [out, in] for the few-row matmuls of decode steps on CPU.
        self.qkv_weight = parameter(hidden, qkv_out, factory=factory)
        self.qkv_bias = (
            parameter(qkv_out, factory=factory, fill=0.0) if config.attention_bias else None
        )
        self.o_weight = parameter(config.num_heads * config.head_dim, hidden, factory=factory)
        self.o_bias = parameter(hidden, factory=factory, fill=0.0) if config.output_bias else None
        self.post_attn_norm = parameter(hidden, factory=factory, fill=1.0)
        self.gate_up_weight = parameter(hidden, 2 * config.intermediate_size, factory=factory)
        self.down_weight = parameter(config.intermediate_size, hidden, factory=factory)
        # Packed (quantized) forms of the projections, by parameter name, when the
        # checkpoint had them; the float32 parameter is then None (same values, 3.5-5x
        # the bytes: a model never holds both).
        self.packed: dict[str, PackedWeight] = {}

    def projection(self, name: str) -> torch.Tensor | PackedWeight:
        """A projection weight in the form this layer holds it."""
        packed = self.packed.get(name)
        return packed if packed is not None else getattr(self, name)

    def _mm(
        self,
        x: torch.Tensor,
        name: str,
        meta: AttentionMetadata,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x @ W (+ bias), plus the step's adapters' low-rank products on their rows."""
        out = self.matmul.mm(x, self.projection(name), bias)
        if meta.lora is not None:
            meta.lora.add(self.index, name, x, out, self.lora_kernel)
        return out

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        heads, kv_heads, hd = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.rms_norm(hidden, self.input_norm.shape, self.input_norm, self.eps)
        qkv = self._mm(x, "qkv_weight", meta, self.qkv_bias)
        qk = qkv[:, : (heads + kv_heads) * hd].view(num_tokens, heads + kv_heads, hd)
        v = qkv[:, (heads + kv_heads) * hd :].view(num_tokens, kv_heads, hd)
        half = hd // 2
        rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        qk = torch.addcmul(qk * cos, rotated, sin)
        attn = self.attn_impl(
            qk[:, :heads], qk[:, heads:], v, kv_cache[0], kv_cache[1], meta, self.scale
        )
        attn_out = self._mm(attn.reshape(num_tokens, heads * hd), "o_weight", meta, self.o_bias)
        attn_out = self.reduce(attn_out)
        hidden = hidden + attn_out
        x = F.rms_norm(hidden, self.post_attn_norm.shape, self.post_attn_norm, self.eps)
        gate_up = self._mm(x, "gate_up_weight", meta)
        gate, up = gate_up.chunk(2, dim=-1)
        return hidden + self.reduce(self._mm(F.silu(gate) * up, "down_weight", meta))

    def forward_fused(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        ops: CpuFusedOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the residual carried as (hidden, delta) and the small ops fused:
        the previous layer's output is hidden + delta; this returns its own pair."""
        num_tokens = hidden.shape[0]
        heads, kv_heads, hd = self.num_heads, self.num_kv_heads, self.head_dim
        x = ops.add_rms_norm(hidden, delta, self.input_norm, self.eps)
        qkv = self._mm(x, "qkv_weight", meta, self.qkv_bias)
        if not qkv.is_contiguous():  # rope_kv_unchecked writes through raw pointers
            qkv = qkv.contiguous()
        ops.rope_kv_unchecked(  # the model checked the step's tensors once (forward)
            qkv, heads, kv_heads, hd, positions, rope[0], rope[1],
            kv_cache[0], kv_cache[1], meta.slot_mapping,
        )  # fmt: skip
        q = qkv[:, : heads * hd].view(num_tokens, heads, hd)
        attn = self.attn_impl.attend(q, kv_cache[0], kv_cache[1], meta, self.scale)
        attn_out = self._mm(attn.reshape(num_tokens, heads * hd), "o_weight", meta, self.o_bias)
        attn_out = self.reduce(attn_out)
        x = ops.add_rms_norm(hidden, attn_out, self.post_attn_norm, self.eps)
        gate_up = self._mm(x, "gate_up_weight", meta)
        act = ops.silu_mul(gate_up)
        return hidden, self.reduce(self._mm(act, "down_weight", meta))


def whole(partial: torch.Tensor) -> torch.Tensor:
    """One process holds the whole model: a projection's output is already the sum."""
    return partial
