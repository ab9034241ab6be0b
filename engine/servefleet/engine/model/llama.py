"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral) over a flat token batch.

Shaped for few ops per layer: q/k/v are one matmul, gate/up are one matmul, q and k get
rotated together in one pass, and the cos/sin rows are gathered once per step for every
layer. Weights arrive in Hugging Face naming (`model.layers.N.self_attn.q_proj.weight`)
from every loader and are fused here, so the loaders never know the module's layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servefleet.engine.attention import AttentionMetadata, PagedAttention
from servefleet.engine.kernels.cpu_fused_ops import (
    CpuFusedOps,
    DecodeLayers,
    LayerTensors,
    ModelShape,
)
from servefleet.engine.kernels.cpu_paged_decode import CpuPagedDecode
from servefleet.engine.kernels.matmul import TORCH_MATMUL, Matmul, SmallRowsMatmul
from servefleet.engine.kernels.packed_weights import (
    BlockQuantized,
    PackedWeight,
    PackingError,
    concat_rows,
    pack,
)
from servefleet.engine.memory import empty_on_huge_pages
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.rope import rope_table

KVCache = tuple[torch.Tensor, torch.Tensor]


class MissingWeightError(KeyError):
    """A checkpoint lacks a tensor the model needs."""


def _weight(*shape: int, factory: dict[str, Any], fill: float | None = None) -> nn.Parameter:
    tensor = torch.empty(*shape, **factory) if fill is None else torch.full(shape, fill, **factory)
    return nn.Parameter(tensor, requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, attn_impl: PagedAttention, factory: dict[str, Any]
    ) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5
        self.attn_impl = attn_impl
        self.matmul: Matmul = TORCH_MATMUL
        hidden = config.hidden_size
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.input_norm = _weight(hidden, factory=factory, fill=1.0)
        # Projection weights are stored [in, out]: `x @ w` on that layout is markedly faster
        # than F.linear on [out, in] for the few-row matmuls of decode steps on CPU.
        self.qkv_weight = _weight(hidden, qkv_out, factory=factory)
        self.qkv_bias = (
            _weight(qkv_out, factory=factory, fill=0.0) if config.attention_bias else None
        )
        self.o_weight = _weight(config.num_heads * config.head_dim, hidden, factory=factory)
        self.o_bias = _weight(hidden, factory=factory, fill=0.0) if config.output_bias else None
        self.post_attn_norm = _weight(hidden, factory=factory, fill=1.0)
        self.gate_up_weight = _weight(hidden, 2 * config.intermediate_size, factory=factory)
        self.down_weight = _weight(config.intermediate_size, hidden, factory=factory)
        # Packed (quantized) forms of the projections, by parameter name, when the
        # checkpoint had them: the matmul backend may read these instead (same values).
        self.packed: dict[str, PackedWeight] = {}

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
        packed = self.packed
        qkv = self.matmul.mm(x, self.qkv_weight, self.qkv_bias, packed.get("qkv_weight"))
        qk = qkv[:, : (heads + kv_heads) * hd].view(num_tokens, heads + kv_heads, hd)
        v = qkv[:, (heads + kv_heads) * hd :].view(num_tokens, kv_heads, hd)
        half = hd // 2
        rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        qk = torch.addcmul(qk * cos, rotated, sin)
        attn = self.attn_impl(
            qk[:, :heads], qk[:, heads:], v, kv_cache[0], kv_cache[1], meta, self.scale
        )
        attn_out = self.matmul.mm(
            attn.reshape(num_tokens, heads * hd), self.o_weight, self.o_bias, packed.get("o_weight")
        )
        hidden = hidden + attn_out
        x = F.rms_norm(hidden, self.post_attn_norm.shape, self.post_attn_norm, self.eps)
        gate_up = self.matmul.mm(x, self.gate_up_weight, None, packed.get("gate_up_weight"))
        gate, up = gate_up.chunk(2, dim=-1)
        return hidden + self.matmul.mm(
            F.silu(gate) * up, self.down_weight, None, packed.get("down_weight")
        )

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
        packed = self.packed
        x = ops.add_rms_norm(hidden, delta, self.input_norm, self.eps)
        qkv = self.matmul.mm(x, self.qkv_weight, self.qkv_bias, packed.get("qkv_weight"))
        if not qkv.is_contiguous():  # rope_kv_unchecked writes through raw pointers
            qkv = qkv.contiguous()
        ops.rope_kv_unchecked(  # the model checked the step's tensors once (forward)
            qkv, heads, kv_heads, hd, positions, rope[0], rope[1],
            kv_cache[0], kv_cache[1], meta.slot_mapping,
        )  # fmt: skip
        q = qkv[:, : heads * hd].view(num_tokens, heads, hd)
        attn = self.attn_impl.attend(q, kv_cache[0], kv_cache[1], meta, self.scale)
        attn_out = self.matmul.mm(
            attn.reshape(num_tokens, heads * hd), self.o_weight, self.o_bias, packed.get("o_weight")
        )
        x = ops.add_rms_norm(hidden, attn_out, self.post_attn_norm, self.eps)
        gate_up = self.matmul.mm(x, self.gate_up_weight, None, packed.get("gate_up_weight"))
        act = ops.silu_mul(gate_up)
        return hidden, self.matmul.mm(act, self.down_weight, None, packed.get("down_weight"))


class LlamaForCausalLM(nn.Module):
    """forward() returns final-normed hidden states; compute_logits() projects selected rows."""

    def __init__(
        self,
        config: ModelConfig,
        attn_impl: PagedAttention | None = None,
        max_positions: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.config = config
        self.attn_impl = attn_impl or PagedAttention()
        self.matmul: Matmul = TORCH_MATMUL
        self.max_positions = max_positions or config.max_position_embeddings
        vocab, hidden = config.vocab_size, config.hidden_size
        self.embed_tokens = _weight(vocab, hidden, factory=factory)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.attn_impl, factory) for _ in range(config.num_layers)
        )
        self.norm = _weight(hidden, factory=factory, fill=1.0)
        self.lm_head = (
            None if config.tie_word_embeddings else _weight(vocab, hidden, factory=factory)
        )
        self.packed_lm_head: PackedWeight | None = None
        self.fused_ops: CpuFusedOps | None = None
        self.one_call_decode = True  # False: per-layer Python path (kept for comparison)
        # All layers of a pure decode step in one C call (`_decode_layers_for`): the KV
        # caches it was built for and the program (None where the setup does not allow it).
        # Whatever else it holds addresses of resets it when it changes.
        self._decode_layers: tuple[list[KVCache], DecodeLayers | None] | None = None
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def _build_rope(self) -> None:
        cos, sin = rope_table(
            self.config, self.max_positions, self.embed_tokens.dtype, self.embed_tokens.device
        )
        self.rope_cos, self.rope_sin = cos, sin
        self._decode_layers = None  # it holds the old tables' addresses

    def set_attention(self, attn_impl: PagedAttention) -> None:
        """Swap the attention implementation (e.g. for one with a Triton decode kernel)."""
        self.attn_impl = attn_impl
        self._decode_layers = None
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.attn_impl = attn_impl

    def set_fused_ops(self, ops: CpuFusedOps | None) -> None:
        """Use the fused C ops (rms_norm, RoPE + KV write) where the tensors allow it."""
        self.fused_ops = ops
        self._decode_layers = None

    def set_matmul(self, matmul: Matmul) -> None:
        """Swap the matmul backend (e.g. the C few-row kernels on CPU); weight layouts stay."""
        self.matmul = matmul
        self._decode_layers = None
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.matmul = matmul

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids/positions: [T]; returns final-normed hidden states [T, hidden]."""
        if self.rope_cos.shape[0] != self.max_positions or self.rope_cos.dtype != (
            self.embed_tokens.dtype
        ):
            self._build_rope()
        hidden = F.embedding(input_ids, self.embed_tokens)
        ops = self.fused_ops
        if (
            ops is not None
            and ops.supports(hidden, self.rope_cos)
            and all(ops.supports_cache(c) for c in kv_caches[0])
        ):
            decode_layers = self._decode_layers_for(ops, kv_caches, meta, hidden.shape[0])
            if decode_layers is not None:
                assert meta.decode_block_tables is not None
                assert meta.decode_context_lens is not None
                return decode_layers.run(
                    hidden, positions, meta.slot_mapping, meta.decode_block_tables,
                    meta.decode_context_lens,
                )  # fmt: skip
            delta: torch.Tensor | None = None
            rope = (self.rope_cos, self.rope_sin)
            config = self.config
            ops.check_rope_kv(
                hidden.shape[0], (config.num_heads + 2 * config.num_kv_heads) * config.head_dim,
                config.num_heads, config.num_kv_heads, config.head_dim,
                positions, rope[0], rope[1], kv_caches, meta.slot_mapping,
            )  # fmt: skip
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                assert isinstance(layer, DecoderLayer)
                hidden, delta = layer.forward_fused(
                    hidden, delta, positions, rope, kv_cache, meta, ops
                )
            return ops.add_rms_norm(hidden, delta, self.norm, self.config.rms_norm_eps)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return F.rms_norm(hidden, self.norm.shape, self.norm, self.config.rms_norm_eps)

    def _decode_layers_for(
        self, ops: CpuFusedOps, kv_caches: list[KVCache], meta: AttentionMetadata, rows: int
    ) -> DecodeLayers | None:
        """The one-call decode program when this step can use it: a pure decode step of
        at most the C matmuls' rows, every projection packed, the C attention kernel."""
        matmul, kernel = self.matmul, self.attn_impl.decode_kernel
        if (
            not self.one_call_decode
            or meta.prefills
            or meta.num_decodes != rows
            or not isinstance(matmul, SmallRowsMatmul)
            or rows > matmul.max_rows
            or not isinstance(kernel, CpuPagedDecode)
        ):
            return None
        cached = self._decode_layers
        if cached is None or cached[0] is not kv_caches:  # the runner passes one list a run
            cached = (kv_caches, self._build_decode_layers(ops, matmul, kernel, kv_caches))
            self._decode_layers = cached
        return cached[1]

    def _build_decode_layers(
        self,
        ops: CpuFusedOps,
        matmul: SmallRowsMatmul,
        kernel: CpuPagedDecode,
        kv_caches: list[KVCache],
    ) -> DecodeLayers | None:
        names = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
        layers: list[LayerTensors] = []
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            packed = [layer.packed.get(n) for n in names]
            if any(p is None for p in packed):
                return None
            qkv, o, gate_up, down = (p for p in packed if p is not None)
            layers.append(
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
        config = self.config
        shape = ModelShape(
            hidden=config.hidden_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, intermediate=config.intermediate_size,
            eps=config.rms_norm_eps, scale=config.head_dim**-0.5,
        )  # fmt: skip
        return DecodeLayers(
            ops, shape, layers, self.rope_cos, self.rope_sin, self.norm,
            matmul.kernel.library, kernel.library,
        )  # fmt: skip

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return self.matmul.linear(hidden, weight, self.packed_lm_head).float()

    def attach_packed(self, packed: Mapping[str, PackedWeight]) -> None:
        """Adopt packed forms of float32 weights (`fuse_packed_weights` names).

        Only float32 CPU models take them: the packed kernels compute in float32, and
        they return exactly what the float32 weights give.
        """
        if self.norm.dtype != torch.float32 or self.norm.device.type != "cpu":
            return
        params = dict(self.named_parameters())
        for name, weight in packed.items():
            dense = self.embed_tokens if name == "lm_head" and self.lm_head is None else None
            dense = dense if dense is not None else params.get(name)
            if dense is None:
                raise MissingWeightError(f"packed weight {name!r} has no float32 counterpart")
            k, n = (dense.shape[1], dense.shape[0]) if name == "lm_head" else dense.shape
            if (weight.k, weight.n) != (k, n):
                raise PackingError(
                    f"packed {name!r} is [{weight.k}, {weight.n}], the model's weight [{k}, {n}]"
                )
            self._decode_layers = None
            if name == "lm_head":
                self.packed_lm_head = weight
            else:
                layer_index, _, param = name.removeprefix("layers.").partition(".")
                layer = self.layers[int(layer_index)]
                assert isinstance(layer, DecoderLayer)
                layer.packed[param] = weight

    def packed_summary(self) -> dict[str, int]:
        """Packed weights attached: how many, and their bytes."""
        weights: list[PackedWeight] = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            weights.extend(layer.packed.values())
        if self.packed_lm_head is not None:
            weights.append(self.packed_lm_head)
        return {"tensors": len(weights), "bytes": sum(w.nbytes for w in weights)}

    @torch.no_grad()
    def load_weights(
        self, state: Mapping[str, torch.Tensor], device: torch.device | str | None = None
    ) -> None:
        """Adopt a fused state dict (see `fuse_hf_weights`), converting dtype/device as needed.

        Tensors already in the right dtype and device are used as they are (no copy), so a
        memory-mapped cache file backs the parameters directly.
        """
        dtype = self.norm.dtype
        if device is None:
            device = torch.device("cpu") if self.norm.is_meta else self.norm.device
        converted = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
        missing = set(self.state_dict()) - set(converted)
        if missing:
            raise MissingWeightError(f"weights lack tensors: {sorted(missing)[:5]}")
        self.load_state_dict(converted, strict=True, assign=True)
        self._build_rope()


def fuse_hf_weights(
    config: ModelConfig, weights: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """HF-named tensors -> this module's state dict (q/k/v and gate/up concatenated).

    Projection weights come out transposed to [in, out] and contiguous (see DecoderLayer).
    """

    def take(name: str) -> torch.Tensor:
        tensor = weights.get(name)
        if tensor is None:
            raise MissingWeightError(f"checkpoint lacks tensor {name!r}")
        return tensor

    state = {
        "embed_tokens": take("model.embed_tokens.weight"),
        "norm": take("model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        state["lm_head"] = take("lm_head.weight")
    for index in range(config.num_layers):
        hf = f"model.layers.{index}."
        ours = f"layers.{index}."
        state[ours + "input_norm"] = take(hf + "input_layernorm.weight")
        state[ours + "post_attn_norm"] = take(hf + "post_attention_layernorm.weight")
        state[ours + "qkv_weight"] = _in_out(
            torch.cat([take(f"{hf}self_attn.{p}_proj.weight") for p in ("q", "k", "v")])
        )
        if config.attention_bias:
            state[ours + "qkv_bias"] = torch.cat(
                [take(f"{hf}self_attn.{p}_proj.bias") for p in ("q", "k", "v")]
            )
        state[ours + "o_weight"] = _in_out(take(hf + "self_attn.o_proj.weight"))
        if config.output_bias:
            state[ours + "o_bias"] = take(hf + "self_attn.o_proj.bias")
        state[ours + "gate_up_weight"] = _in_out(
            torch.cat([take(hf + "mlp.gate_proj.weight"), take(hf + "mlp.up_proj.weight")])
        )
        state[ours + "down_weight"] = _in_out(take(hf + "mlp.down_proj.weight"))
    return state


def fuse_packed_weights(
    config: ModelConfig, quantized: Mapping[str, BlockQuantized]
) -> dict[str, PackedWeight]:
    """Block-quantized HF tensors -> packed forms under this module's parameter names.

    A fused projection is packed only when all its parts share one block format; the
    lm_head ("lm_head") comes from the embedding when the two are tied.
    """
    packed: dict[str, PackedWeight] = {}

    def add(ours: str, names: list[str]) -> None:
        parts = [quantized.get(n) for n in names]
        if any(p is None for p in parts):
            return
        fused = concat_rows([p for p in parts if p is not None])
        if fused is not None:
            packed[ours] = pack(fused)

    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    add("lm_head", [head])
    for index in range(config.num_layers):
        hf = f"model.layers.{index}."
        ours = f"layers.{index}."
        add(ours + "qkv_weight", [f"{hf}self_attn.{p}_proj.weight" for p in ("q", "k", "v")])
        add(ours + "o_weight", [hf + "self_attn.o_proj.weight"])
        add(ours + "gate_up_weight", [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"])
        add(ours + "down_weight", [hf + "mlp.down_proj.weight"])
    return packed


def _in_out(weight_out_in: torch.Tensor) -> torch.Tensor:
    return weight_out_in.t().contiguous()


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (keys and values)."""
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCache]:
    """One allocation for the whole cache; per-layer (k, v) views of it, each contiguous."""
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    if torch.device(device).type == "cpu":  # attention reads scattered blocks: fewer TLB misses
        storage = empty_on_huge_pages(shape, dtype).zero_()
    else:
        storage = torch.zeros(shape, dtype=dtype, device=device)
    return [(storage[i, 0], storage[i, 1]) for i in range(config.num_layers)]
