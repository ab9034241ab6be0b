"""The decoder's small per-layer ops fused in C (`cpu_fused_ops.c`), for float32 on CPU.

PyTorch runs rms_norm as six dispatched ops, RoPE plus the KV-cache write as six more
and SwiGLU as three; at decode sizes (16 rows) their dispatch costs ~8 ms of a ~40 ms
step. These calls do the same arithmetic in one pass each. The model uses them only when every
tensor is float32, contiguous and on the CPU, and keeps its PyTorch path otherwise.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from servefleet.engine.kernels import cbuild
from servefleet.engine.kernels.cbuild import KernelBuildError
from servefleet.engine.kernels.cpu_paged_decode import ERROR_MESSAGES as ATTENTION_ERRORS
from servefleet.engine.kernels.packed_weights import PackedWeight

logger = logging.getLogger("servefleet.engine.kernels")

SOURCE_PATH = Path(__file__).with_name("cpu_fused_ops.c")
# No -fassociative-math: the rms_norm reduction order is written out and must stay.
OPTIMISE_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast")

_P = ctypes.c_void_p
_I = ctypes.c_int64
ROPE_ERRORS = {
    1: "a position is outside the rope table (longer than max_model_len?)",
    2: "a KV-cache slot is outside the cache",
}


_CACHE_DTYPES = (torch.float32, torch.float16)


def _is_f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


@dataclass(frozen=True)
class CpuFusedOps:
    library: ctypes.CDLL
    path: Path

    def supports(self, *tensors: torch.Tensor) -> bool:
        """True when the fused ops can take these tensors (float32, CPU, contiguous)."""
        return all(_is_f32(t) for t in tensors)

    @staticmethod
    def supports_cache(cache: torch.Tensor) -> bool:
        """KV caches rope_kv writes: float32 or float16, contiguous, on the CPU."""
        return cache.dtype in _CACHE_DTYPES and cache.is_cpu and cache.is_contiguous()

    def add_rms_norm(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """`hidden += delta` in place (when given), then rms_norm(hidden) * weight."""
        rows, dim = hidden.shape
        if not (_is_f32(hidden) and _is_f32(weight) and weight.shape == (dim,)) or (
            delta is not None and not (_is_f32(delta) and delta.shape == hidden.shape)
        ):
            raise ValueError("add_rms_norm: float32 contiguous CPU tensors of matching shapes")
        out = torch.empty_like(hidden)
        self.library.sf_add_rms_norm(
            hidden.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            ctypes.c_float(eps),
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2·I] = [gate | up]; returns [T, I]."""
        rows, width = gate_up.shape
        if not _is_f32(gate_up) or width % 2:
            raise ValueError("silu_mul: a contiguous float32 CPU [T, 2·I] tensor")
        out = torch.empty(rows, width // 2)
        self.library.sf_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def rope_kv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Rotate q and k of `qkv` [T, (H + 2·KVH)·hd] in place and store k, v in the cache."""
        if not _is_f32(qkv) or qkv.dim() != 2:
            raise ValueError("rope_kv: qkv must be a contiguous float32 CPU [T, width] tensor")
        self.check_rope_kv(
            qkv.shape[0], qkv.shape[1], num_heads, num_kv_heads, head_dim, positions, cos, sin,
            [(k_cache, v_cache)], slots,
        )  # fmt: skip
        self.rope_kv_unchecked(
            qkv, num_heads, num_kv_heads, head_dim, positions, cos, sin, k_cache, v_cache, slots
        )

    def check_rope_kv(
        self,
        tokens: int,
        width: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        slots: torch.Tensor,
    ) -> None:
        """Everything `rope_kv_unchecked` relies on, for a step's qkv of [tokens, width]
        and every layer's caches: checked once per step instead of once per layer. The
        C code itself rejects positions and slots out of range."""
        if width != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
            raise ValueError(f"rope_kv: qkv width {width} does not match the heads")
        first = caches[0][0]
        if not (
            _is_f32(cos) and _is_f32(sin) and cos.shape == sin.shape and cos.dim() == 2
            and cos.shape[-1] == head_dim
            and positions.dtype == torch.int64 and slots.dtype == torch.int64
            and positions.shape == (tokens,) and slots.shape == (tokens,)
            and positions.is_contiguous() and slots.is_contiguous()
            and first.shape[-1] == head_dim and first.shape[-2] == num_kv_heads
            and all(
                self.supports_cache(c) and c.dtype == first.dtype and c.shape == first.shape
                for pair in caches for c in pair
            )
        ):  # fmt: skip
            raise ValueError("rope_kv: tensors of the wrong dtype, layout or shape")

    def rope_kv_unchecked(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """`rope_kv` for arguments `check_rope_kv` accepted (qkv: contiguous float32)."""
        tokens, width = qkv.shape
        status = self.library.sf_rope_kv(
            qkv.data_ptr(), tokens, width, num_heads, num_kv_heads, head_dim,
            positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
            k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.float16),
            slots.data_ptr(), k_cache.numel() // (num_kv_heads * head_dim),
        )  # fmt: skip
        if status:
            raise ValueError(f"rope_kv: {ROPE_ERRORS.get(status, f'error {status}')}")


def _open(path: Path) -> ctypes.CDLL:
    library = cbuild.open_library(path, "single")
    library.sf_add_rms_norm.argtypes = [_P, _P, _P, _P, _I, _I, ctypes.c_float]
    library.sf_add_rms_norm.restype = None
    library.sf_silu_mul.argtypes = [_P, _P, _I, _I]
    library.sf_silu_mul.restype = None
    library.sf_rope_kv.argtypes = [
        _P, _I, _I, _I, _I, _I, _P, _P, _P, _I, _P, _P, ctypes.c_int, _P, _I,
    ]  # fmt: skip
    library.sf_rope_kv.restype = ctypes.c_int
    library.sf_decode_layers.argtypes = [_P, _P, _P, _P, _I, _P, _P, _P, _P, _I, ctypes.c_int]
    library.sf_decode_layers.restype = ctypes.c_int
    return library


@functools.cache
def load_cpu_fused_ops() -> CpuFusedOps | None:
    """The compiled fused ops, or None (with the reason logged) when they cannot be built."""
    try:
        path = cbuild.build_library(SOURCE_PATH, OPTIMISE_FLAGS, "single")
        library = _open(path)
    except (KernelBuildError, OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU fused ops unavailable, using PyTorch ops: %s", exc)
        return None
    return CpuFusedOps(library=library, path=path)


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
        ("cache_f16", ctypes.c_int32),
    ]


DECODE_LAYERS_ERRORS = {
    1: "a position is outside the rope table",
    2: "a KV-cache slot is outside the cache",
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
    ) -> None:
        first = layers[0].k_cache
        for t in (cos, sin, final_norm):
            if not _is_f32(t):
                raise ValueError("decode layers: rope tables and norms must be float32")
        for layer in layers:
            if not all(_same_cache(c, first) for c in (layer.k_cache, layer.v_cache)) or not all(
                _is_f32(t) for t in (layer.input_norm, layer.post_norm)
            ):
                raise ValueError("decode layers: caches and norms of one dtype and shape")
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
            packed_mm=ctypes.cast(packed_mm.sf_packed_mm, ctypes.c_void_p).value,
            paged_decode=ctypes.cast(paged_decode.sf_paged_decode, ctypes.c_void_p).value,
            eps=shape.eps,
            scale=shape.scale,
            cache_f16=int(first.dtype == torch.float16),
        )

    def run(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """hidden: the step's token embeddings [D, hidden] (used as the residual stream);
        returns the final-normed hidden states [D, hidden]."""
        rows = hidden.shape[0]
        if not (
            _is_f32(hidden) and hidden.shape[1] == self.shape.hidden
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
        status = self._ops.library.sf_decode_layers(
            ctypes.byref(self._model), ctypes.cast(self._layers, ctypes.c_void_p),
            hidden.data_ptr(), out.data_ptr(), rows,
            positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
            context_lens.data_ptr(), block_tables.shape[1], torch.get_num_threads(),
        )  # fmt: skip
        if status:
            if status >= 20:
                reason = f"attention: {ATTENTION_ERRORS.get(status - 20, status - 20)}"
            elif status >= 10:
                reason = f"packed matmul error {status - 10}"
            else:
                reason = DECODE_LAYERS_ERRORS.get(status, f"error {status}")
            raise ValueError(f"decode layers: {reason}")
        return out


def _same_cache(cache: torch.Tensor, first: torch.Tensor) -> bool:
    return (
        CpuFusedOps.supports_cache(cache)
        and cache.dtype == first.dtype
        and cache.shape == first.shape
    )
