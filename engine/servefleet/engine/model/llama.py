"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral) over a flat token batch.

Shaped for few ops per layer: q/k/v are one matmul, gate/up are one matmul, q and k get
rotated together in one pass, and the cos/sin rows are gathered once per step for every
layer. Weights arrive fused (`weights.fuse_hf_weights`); a projection a quantized checkpoint
stored packed is held only in that form (`PackedWeight`, 3.5-5x smaller than float32) and
handed to the matmul backend as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servefleet.engine.attention import AttentionMetadata, PagedAttention
from servefleet.engine.kernels.cpu_fused_ops import CpuFusedOps
from servefleet.engine.kernels.cpu_paged_decode import CpuPagedDecode
from servefleet.engine.kernels.decode_layers import DecodeLayers
from servefleet.engine.kernels.lora_layout import LoraKernel, LoraStep
from servefleet.engine.kernels.matmul import TORCH_MATMUL, Matmul, SmallRowsMatmul
from servefleet.engine.kernels.packed_weights import PackedWeight, PackingError
from servefleet.engine.model.config import ModelConfig
from servefleet.engine.model.decode_program import build_decode_layers, lora_step_in_c
from servefleet.engine.model.decoder_layer import DecoderLayer, Reduce, parameter
from servefleet.engine.model.kv_layout import KVCache
from servefleet.engine.model.rope import rope_table
from servefleet.engine.model.weights import LM_HEAD, MissingWeightError, projection_shapes
from servefleet.engine.parallel.embedding import vocab_parallel_embedding


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
        self.lora_kernel: LoraKernel | None = None
        self.reduce: Reduce | None = None  # set_tensor_parallel
        self.vocab_start = 0  # the first token id of this rank's embedding rows
        self.last_stage = True  # False: a pipeline stage handing its sum to the next
        self.max_positions = max_positions or config.max_position_embeddings
        vocab, hidden = config.vocab_size, config.hidden_size
        self.embed_tokens = parameter(vocab, hidden, factory=factory)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.attn_impl, factory, index)
            for index in range(config.num_layers)
        )
        self.norm = parameter(hidden, factory=factory, fill=1.0)
        self.lm_head = (
            None if config.tie_word_embeddings else parameter(vocab, hidden, factory=factory)
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

    def set_tensor_parallel(self, reduce: Reduce, vocab_start: int) -> None:
        """Run as one rank's shard (`parallel.shard`): `reduce` sums the row-parallel
        partials and embedding rows across ranks. All layers in one C call has no place
        for the all-reduces between them, so decode steps take the per-layer path."""
        self.reduce, self.vocab_start = reduce, vocab_start
        self.one_call_decode = False
        self._decode_layers = None
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.reduce = reduce

    def set_pipeline_stage(self, last: bool) -> None:
        """Run as one pipeline stage (its layers only, `parallel.stages`); the one-call
        decode program ends in the final norm, so decode steps take the per-layer path."""
        self.last_stage = last
        self.one_call_decode = False
        self._decode_layers = None

    def set_lora_kernel(self, kernel: LoraKernel | None) -> None:
        """Add the step's adapter products through `kernel` (C on CPU, Triton on GPU) where
        it takes the tensors; None keeps the PyTorch path."""
        self.lora_kernel = kernel
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.lora_kernel = kernel

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        hidden_in: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids/positions: [T]; returns final-normed hidden states [T, hidden].
        A pipeline stage (`set_pipeline_stage`) after the first starts from `hidden_in`
        (the previous stage's output); one before the last returns the un-normed sum."""
        if self.rope_cos.shape[0] != self.max_positions or self.rope_cos.dtype != (
            self.embed_tokens.dtype
        ):
            self._build_rope()
        hidden = self._embed(input_ids) if hidden_in is None else hidden_in
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
                lora = self._program_lora(meta, hidden.shape[0])
                return decode_layers.run(
                    hidden, positions, meta.slot_mapping, meta.decode_block_tables,
                    meta.decode_context_lens, lora,
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
            if not self.last_stage:  # the next stage adds the pair itself
                return hidden if delta is None else hidden + delta
            return ops.add_rms_norm(hidden, delta, self.norm, self.config.rms_norm_eps)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        if not self.last_stage:
            return hidden
        return F.rms_norm(hidden, self.norm.shape, self.norm, self.config.rms_norm_eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.reduce is None:
            return F.embedding(input_ids, self.embed_tokens)
        return vocab_parallel_embedding(input_ids, self.embed_tokens, self.vocab_start, self.reduce)

    def _decode_layers_for(
        self, ops: CpuFusedOps, kv_caches: list[KVCache], meta: AttentionMetadata, rows: int
    ) -> DecodeLayers | None:
        """The one-call decode program when this step can use it: a pure decode step of
        at most the C matmuls' rows, every projection packed, the C attention kernel, and
        its adapters (if any) in the C LoRA kernel of the same library."""
        matmul, kernel = self.matmul, self.attn_impl.decode_kernel
        if (
            not self.one_call_decode
            or (
                meta.lora is not None
                and lora_step_in_c(meta.lora, self.lora_kernel, matmul, rows) is None
            )
            or meta.prefills
            or meta.num_decodes != rows
            or not isinstance(matmul, SmallRowsMatmul)
            or rows > matmul.max_rows
            or not isinstance(kernel, CpuPagedDecode)
        ):
            return None
        cached = self._decode_layers
        if cached is None or cached[0] is not kv_caches:  # the runner passes one list a run
            layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
            program = build_decode_layers(
                self.config, layers, kv_caches, (self.rope_cos, self.rope_sin), self.norm,
                (ops, matmul, kernel),
            )  # fmt: skip
            cached = (kv_caches, program)
            self._decode_layers = cached
        return cached[1]

    def _program_lora(self, meta: AttentionMetadata, rows: int) -> LoraStep | None:
        if meta.lora is None:
            return None
        step = lora_step_in_c(meta.lora, self.lora_kernel, self.matmul, rows)
        assert step is not None  # _decode_layers_for admitted the step
        meta.lora.ran.add("program")
        return step

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        dense = self.embed_tokens if self.lm_head is None else self.lm_head
        weight: torch.Tensor | PackedWeight | None = self.packed_lm_head
        # Batch-invariant mode keeps the decode steps' form of the weight for every call.
        many_rows = (
            isinstance(self.matmul, SmallRowsMatmul)
            and not self.matmul.invariant
            and hidden.shape[0] > self.matmul.max_rows
        )
        if weight is None or (many_rows and dense is not None):
            weight = dense  # a tied embedding is there anyway: no unpacking for prompt logits
        assert weight is not None
        return self.matmul.linear(hidden, weight).float()

    def attach_packed(self, packed: Mapping[str, PackedWeight]) -> None:
        """Hold these weights packed (`fuse_packed_weights` names) and drop their float32
        parameters (a tied embedding stays: the embedding lookup reads it).

        Only float32 CPU models take them: the packed kernels compute in float32, and
        they return exactly what the float32 weights give.
        """
        _check_packable(self.norm.dtype, self.norm.device)
        self._adopt_packed(packed)

    def _adopt_packed(self, packed: Mapping[str, PackedWeight]) -> None:
        shapes = projection_shapes(self.config)
        for name, weight in packed.items():
            if name not in shapes:
                raise MissingWeightError(f"packed weight {name!r} is no projection of the model")
            if (weight.k, weight.n) != shapes[name]:
                k, n = shapes[name]
                raise PackingError(
                    f"packed {name!r} is [{weight.k}, {weight.n}], the model's weight [{k}, {n}]"
                )
        self._decode_layers = None
        for name, weight in packed.items():
            if name == LM_HEAD:
                self.packed_lm_head = weight
                if self.lm_head is not None:
                    self.lm_head = None
                continue
            layer_index, _, param = name.removeprefix("layers.").partition(".")
            layer = self.layers[int(layer_index)]
            assert isinstance(layer, DecoderLayer)
            layer.packed[param] = weight
            setattr(layer, param, None)

    def packed_summary(self) -> dict[str, int]:
        """Packed weights attached: how many, and their bytes."""
        weights: list[PackedWeight] = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            weights.extend(layer.packed.values())
        if self.packed_lm_head is not None:
            weights.append(self.packed_lm_head)
        return {"tensors": len(weights), "bytes": sum(w.nbytes for w in weights)}

    def weight_bytes(self) -> dict[str, int]:
        """Bytes the model's weights take: float parameters and packed weights."""
        dense = sum(p.numel() * p.element_size() for p in self.parameters())
        return {"float": dense, "packed": self.packed_summary()["bytes"]}

    @torch.no_grad()
    def load_weights(
        self,
        state: Mapping[str, torch.Tensor],
        device: torch.device | str | None = None,
        packed: Mapping[str, PackedWeight] | None = None,
    ) -> None:
        """Adopt a fused state dict (see `fuse_hf_weights`), converting dtype/device as needed,
        and the packed weights the state dict lacks (a float32 CPU model only).

        Tensors already in the right dtype and device are used as they are (no copy), so a
        memory-mapped cache file backs the parameters directly.
        """
        dtype = self.norm.dtype
        if device is None:
            device = torch.device("cpu") if self.norm.is_meta else self.norm.device
        if packed:
            _check_packable(dtype, torch.device(device))
            self._adopt_packed(packed)
        converted = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
        missing = set(self.state_dict()) - set(converted)
        if missing:
            raise MissingWeightError(f"weights lack tensors: {sorted(missing)[:5]}")
        self.load_state_dict(converted, strict=True, assign=True)
        self._build_rope()


def _check_packable(dtype: torch.dtype, device: torch.device) -> None:
    if dtype != torch.float32 or device.type != "cpu":
        raise PackingError(f"packed weights need a float32 CPU model, not {dtype} on {device}")
