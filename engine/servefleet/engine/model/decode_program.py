"""The one-call decode program (`DecodeLayers`) for a model whose projections are packed.

A pure decode step through every layer in one C call needs each layer's norms, biases and
packed projections plus the KV cache views; this gathers them, or says the model cannot
run that way (a projection held as float32).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from servefleet.engine.kernels.cpu_fused_ops import CpuFusedOps
from servefleet.engine.kernels.cpu_lora import CpuLoraKernel
from servefleet.engine.kernels.cpu_paged_decode import CpuPagedDecode
from servefleet.engine.kernels.decode_layers import DecodeLayers, LayerTensors, ModelShape
from servefleet.engine.kernels.lora_layout import C_WEIGHT_CODES, LoraKernel, LoraStep
from servefleet.engine.kernels.matmul import Matmul, SmallRowsMatmul
from servefleet.engine.kernels.packed_weights import PackedWeight
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.kv_layout import KVCache
from servefleet.engine.model.weights import PROJECTIONS

if TYPE_CHECKING:
    from servefleet.engine.lora.batch import LoraBatch

# sf_decode_layers adds the adapters' deltas of projection p after the matmul of PROJECTIONS[p]
assert PROJECTIONS == ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


class DecoderWeights(Protocol):
    """What the program reads of a decoder layer."""

    @property
    def input_norm(self) -> torch.Tensor: ...
    @property
    def post_attn_norm(self) -> torch.Tensor: ...
    @property
    def qkv_bias(self) -> torch.Tensor | None: ...
    @property
    def o_bias(self) -> torch.Tensor | None: ...
    @property
    def packed(self) -> Mapping[str, PackedWeight]: ...


def build_decode_layers(
    config: ModelConfig,
    layers: Sequence[DecoderWeights],
    kv_caches: list[KVCache],
    rope: tuple[torch.Tensor, torch.Tensor],
    final_norm: torch.Tensor,
    kernels: tuple[CpuFusedOps, SmallRowsMatmul, CpuPagedDecode],
) -> DecodeLayers | None:
    """The program for these layers and caches; None unless every projection is packed."""
    ops, matmul, kernel = kernels
    tensors: list[LayerTensors] = []
    for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
        packed = [layer.packed.get(n) for n in PROJECTIONS]
        if any(p is None for p in packed):
            return None
        qkv, o, gate_up, down = (p for p in packed if p is not None)
        tensors.append(
            LayerTensors(
                input_norm=layer.input_norm,
                post_norm=layer.post_attn_norm,
                qkv=qkv,
                o=o,
                gate_up=gate_up,
                down=down,
                qkv_bias=layer.qkv_bias,
                o_bias=layer.o_bias,
                k_cache=k_cache,
                v_cache=v_cache,
            )
        )
    shape = ModelShape(
        hidden=config.hidden_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, intermediate=config.intermediate_size,
        eps=config.rms_norm_eps, scale=config.head_dim**-0.5,
    )  # fmt: skip
    bf16_min_rows = matmul.bf16_min_rows if matmul.kernel.bf16_products else None
    return DecodeLayers(
        ops, shape, tensors, rope[0], rope[1], final_norm,
        matmul.kernel.library, kernel.library, bf16_min_rows,
    )  # fmt: skip


def lora_step_in_c(
    lora: LoraBatch, kernel: LoraKernel | None, matmul: Matmul, rows: int
) -> LoraStep | None:
    """A step's adapters as the program's C LoRA kernel takes them, or None (no C LoRA
    kernel, or one of another library than the matmuls', or weights it cannot read)."""
    if (
        not isinstance(kernel, CpuLoraKernel)
        or not isinstance(matmul, SmallRowsMatmul)
        or kernel.gemm is not matmul.kernel  # the program calls the matmul library's
    ):
        return None
    step = lora.kernel_step(rows)
    if step is None or step.weight_dtype not in C_WEIGHT_CODES or not step.table.is_cpu:
        return None
    return step
