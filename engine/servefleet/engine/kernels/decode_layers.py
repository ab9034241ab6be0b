"""Every layer of a pure decode step in one C call (`sf_decode_layers` in `cpu_fused_ops.c`).

Once the per-layer kernels are fast, a 16-sequence decode step spends a tenth of its time
in Python calling them (~270 calls); this hands the C side every layer's addresses once per
(model, KV cache) and runs the step in one call. Float32, float16 and int8 caches (int8:
quantized on write and read with its scales by the C kernels) take the same program, and
so does a step with LoRA adapters: after each projection's matmul (and bias) the matmul
library's `sf_lora_add` adds the step's deltas, as `DecoderLayer._mm` does per layer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from servefleet.engine.kernels.cpu_fused_ops import CpuFusedOps, is_f32
from servefleet.engine.kernels.cpu_lora import LORA_ERRORS, fits
from servefleet.engine.kernels.cpu_paged_decode import CACHE_KINDS
from servefleet.engine.kernels.cpu_paged_decode import ERROR_MESSAGES as ATTENTION_ERRORS
from servefleet.engine.kernels.lora_layout import C_WEIGHT_CODES, FIELDS, LoraStep
from servefleet.engine.kernels.packed_weights import PackedWeight
from servefleet.engine.kv_quant import row_width

_P = ctypes.c_void_p
_I = ctypes.c_int64


class _Packed(ctypes.Structure):
    _fields_ = [("data", _P), ("formats", _P), ("offsets", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv", _Packed),
        ("o", _Packed),
        ("gate_up", _Packed),
        ("down", _Packed),
        ("qkv_bias", _P),
        ("o_bias", _P),
        ("k_cache", _P),
        ("v_cache", _P),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _I),
        ("hidden", _I),
        ("heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("inter", _I),
        ("block_size", _I),
        ("num_blocks", _I),
        ("table_rows", _I),
        ("cos", _P),
        ("sin", _P),
        ("final_norm", _P),
        ("packed_mm", _P),
        ("paged_decode", _P),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cache_kind", ctypes.c_int32),
    ]


class _LoraStep(ctypes.Structure):
    _fields_ = [
        ("add", _P),
        ("row_slots", _P),
        ("table", _P),
        ("num_slots", _I),
        ("fields", _I),
        ("wdtype", ctypes.c_int32),
    ]


DECODE_LAYERS_ERRORS = {
    1: "a position is outside the rope table",
    2: "a KV-cache slot is outside the cache",
    3: "unsupported KV-cache dtype",
    30: "out of memory for the step's buffers",
}


@dataclass(frozen=True)
class LayerTensors:
    """One decoder layer's tensors for `DecodeLayers` (packed weights as uint8 data)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: PackedWeight
    o: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight
    qkv_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


class DecodeLayers:
    """Every layer of a pure decode step (plus the final norm) in one C call.

    Built once per (model, KV cache): it holds the raw addresses of the weights, caches
    and rope tables, so it keeps references to all of them. Runs exactly the kernels the
    model's fused Python path runs, in the same order, so the results are the same bits.
    """

    def __init__(
        self,
        ops: CpuFusedOps,
        shape: ModelShape,
        layers: Sequence[LayerTensors],
        cos: torch.Tensor,
        sin: torch.Tensor,
        final_norm: torch.Tensor,
        packed_mm: ctypes.CDLL,
        paged_decode: ctypes.CDLL,
        bf16_min_rows: int | None = None,
    ) -> None:
        first = layers[0].k_cache
        _check_tensors(shape, layers, (cos, sin, final_norm))
        self._ops = ops
        self._keep = (layers, cos, sin, final_norm)  # the C side holds their addresses
        self.shape = shape
        self.cache_shape = tuple(first.shape)
        self.cache_dtype = first.dtype
        array = (_Layer * len(layers))()
        for slot, layer in zip(array, layers, strict=True):
            slot.input_norm = layer.input_norm.data_ptr()
            slot.post_norm = layer.post_norm.data_ptr()
            for name in ("qkv", "o", "gate_up", "down"):
                weight: PackedWeight = getattr(layer, name)
                packed = _Packed(
                    weight.data.data_ptr(), weight.formats.data_ptr(), weight.offsets.data_ptr()
                )
                setattr(slot, name, packed)
            slot.qkv_bias = None if layer.qkv_bias is None else layer.qkv_bias.data_ptr()
            slot.o_bias = None if layer.o_bias is None else layer.o_bias.data_ptr()
            slot.k_cache = layer.k_cache.data_ptr()
            slot.v_cache = layer.v_cache.data_ptr()
        self._layers = array
        # Steps of bf16_min_rows rows or more use the packed kernel's bfloat16 products.
        self._f32_mm = ctypes.cast(packed_mm.sf_packed_mm, ctypes.c_void_p).value
        self._bf16_mm = ctypes.cast(packed_mm.sf_packed_mm_bf16, ctypes.c_void_p).value
        self._lora_add = ctypes.cast(packed_mm.sf_lora_add, ctypes.c_void_p).value
        self.bf16_min_rows = bf16_min_rows
        self._model = _Model(
            num_layers=len(layers),
            hidden=shape.hidden,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            inter=shape.intermediate,
            block_size=first.shape[1],
            num_blocks=first.shape[0],
            table_rows=cos.shape[0],
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            final_norm=final_norm.data_ptr(),
            packed_mm=self._f32_mm,
            paged_decode=ctypes.cast(paged_decode.sf_paged_decode, ctypes.c_void_p).value,
            eps=shape.eps,
            scale=shape.scale,
            cache_kind=CACHE_KINDS[first.dtype],
        )

    def run(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """hidden: the step's token embeddings [D, hidden] (used as the residual stream);
        returns the final-normed hidden states [D, hidden]. `lora`: the step's adapters."""
        rows = hidden.shape[0]
        if not (
            is_f32(hidden) and hidden.shape[1] == self.shape.hidden
            and positions.dtype == torch.int64 and slots.dtype == torch.int64
            and positions.shape == (rows,) and slots.shape == (rows,)
            and positions.is_contiguous() and slots.is_contiguous()
            and block_tables.dtype == torch.int32 and block_tables.dim() == 2
            and block_tables.shape[0] == rows and block_tables.is_contiguous()
            and context_lens.dtype == torch.int32 and context_lens.shape == (rows,)
            and context_lens.is_contiguous()
        ):  # fmt: skip
            raise ValueError("decode layers: step tensors of the wrong dtype, layout or shape")
        out = torch.empty_like(hidden)
        lora_arg = None if lora is None else ctypes.byref(self._lora_step(hidden, lora))
        bf16 = self.bf16_min_rows is not None and rows >= self.bf16_min_rows
        self._model.packed_mm = self._bf16_mm if bf16 else self._f32_mm
        status = self._ops.library.sf_decode_layers(
            ctypes.byref(self._model), ctypes.cast(self._layers, ctypes.c_void_p),
            hidden.data_ptr(), out.data_ptr(), rows,
            positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
            context_lens.data_ptr(), block_tables.shape[1], torch.get_num_threads(), lora_arg,
        )  # fmt: skip
        if status:
            if status >= 40:
                reason = f"lora: {LORA_ERRORS.get(status - 40, status - 40)}"
            elif status >= 20:
                reason = f"attention: {ATTENTION_ERRORS.get(status - 20, status - 20)}"
            elif status >= 10:
                reason = f"packed matmul error {status - 10}"
            else:
                reason = DECODE_LAYERS_ERRORS.get(status, f"error {status}")
            raise ValueError(f"decode layers: {reason}")
        return out

    def _lora_step(self, hidden: torch.Tensor, lora: LoraStep) -> _LoraStep:
        """The step's adapters as the C side reads them, checked as `CpuLoraKernel` checks
        them (the table's entries are checked by the C kernel itself)."""
        table = lora.table
        if not fits(hidden, hidden, lora) or table.shape[1:3] != (len(self._layers), 4):
            raise ValueError("decode layers: a LoRA step of the wrong dtype, layout or shape")
        return _LoraStep(
            add=self._lora_add,
            row_slots=lora.row_slots.data_ptr(),
            table=table.data_ptr(),
            num_slots=table.shape[0],
            fields=FIELDS,
            wdtype=C_WEIGHT_CODES[lora.weight_dtype],
        )


def _check_tensors(
    shape: ModelShape, layers: Sequence[LayerTensors], tables: Sequence[torch.Tensor]
) -> None:
    """What the C side will read through raw pointers: float32 tables and norms, and
    caches of one dtype and shape whose rows fit the model's heads."""
    if not all(is_f32(t) for t in tables):
        raise ValueError("decode layers: rope tables and norms must be float32")
    first = layers[0].k_cache
    if first.dim() != 4 or tuple(first.shape[-2:]) != (
        shape.kv_heads, row_width(shape.head_dim, first.dtype)
    ):  # fmt: skip
        raise ValueError("decode layers: cache rows do not fit the model's kv heads")
    for layer in layers:
        if not all(_same_cache(c, first) for c in (layer.k_cache, layer.v_cache)) or not all(
            is_f32(t) for t in (layer.input_norm, layer.post_norm)
        ):
            raise ValueError("decode layers: caches and norms of one dtype and shape")


def _same_cache(cache: torch.Tensor, first: torch.Tensor) -> bool:
    return (
        CpuFusedOps.supports_cache(cache)
        and cache.dtype == first.dtype
        and cache.shape == first.shape
    )
