"""The decoder's small per-layer ops fused in C (`cpu_fused_ops.c`), for float32 on CPU.

PyTorch runs rms_norm as six dispatched ops, RoPE plus the KV-cache write as six more
and SwiGLU as three; at decode sizes (16 rows) their dispatch costs ~8 ms of a ~40 ms
step. These calls do the same arithmetic in one pass each. The model uses them only when every
tensor is float32, contiguous and on the CPU, and keeps its PyTorch path otherwise. The KV
write takes float32, float16 and int8 caches (int8 quantized on write exactly as
`kv_quant.quantize_rows` does), so a quantized cache keeps the fused path. The one-call
decode step over these ops is `decode_layers`.
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
from servefleet.engine.kernels.cpu_paged_decode import CACHE_KINDS
from servefleet.engine.kv_quant import row_width

logger = logging.getLogger("servefleet.engine.kernels")

SOURCE_PATH = Path(__file__).with_name("cpu_fused_ops.c")
# No -fassociative-math: the rms_norm reduction order is written out and must stay.
OPTIMISE_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast")

_P = ctypes.c_void_p
_I = ctypes.c_int64
ROPE_ERRORS = {
    1: "a position is outside the rope table (longer than max_model_len?)",
    2: "a KV-cache slot is outside the cache",
    3: "unsupported KV-cache dtype",
}


# What sf_rope_kv writes; int8 rows carry their scale inline (kv_quant).
_CACHE_DTYPES = (torch.float32, torch.float16, torch.int8)


def is_f32(t: torch.Tensor) -> bool:
    """A float32, contiguous CPU tensor: what the C code reads through a raw pointer."""
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


@dataclass(frozen=True)
class CpuFusedOps:
    library: ctypes.CDLL
    path: Path

    def supports(self, *tensors: torch.Tensor) -> bool:
        """True when the fused ops can take these tensors (float32, CPU, contiguous)."""
        return all(is_f32(t) for t in tensors)

    @staticmethod
    def supports_cache(cache: torch.Tensor) -> bool:
        """KV caches rope_kv writes: float32, float16 or int8, contiguous, on the CPU."""
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
        if not (is_f32(hidden) and is_f32(weight) and weight.shape == (dim,)) or (
            delta is not None and not (is_f32(delta) and delta.shape == hidden.shape)
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
        if not is_f32(gate_up) or width % 2:
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
        if not is_f32(qkv) or qkv.dim() != 2:
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
            is_f32(cos) and is_f32(sin) and cos.shape == sin.shape and cos.dim() == 2
            and cos.shape[-1] == head_dim
            and positions.dtype == torch.int64 and slots.dtype == torch.int64
            and positions.shape == (tokens,) and slots.shape == (tokens,)
            and positions.is_contiguous() and slots.is_contiguous()
            and first.shape[-1] == row_width(head_dim, first.dtype)
            and first.shape[-2] == num_kv_heads
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
            k_cache.data_ptr(), v_cache.data_ptr(), CACHE_KINDS[k_cache.dtype],
            slots.data_ptr(), k_cache.numel() // (num_kv_heads * k_cache.shape[-1]),
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
    library.sf_decode_layers.argtypes = [
        _P, _P, _P, _P, _I, _P, _P, _P, _P, _I, ctypes.c_int, _P,
    ]  # fmt: skip
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
