"""The matmuls a decoder makes, behind one small interface the model is handed.

The model calls `mm` for its [in, out] projection weights and `linear` for the
[out, in] lm_head, so a backend can pick a kernel per call (by row count, dtype,
device) without the model knowing; `TORCH_MATMUL` is the default everywhere. When the
checkpoint was quantized, the model hands over the weight's packed form instead of a
float32 tensor (it keeps no float32 copy of it): the C kernels read it as it is, and
everything else multiplies its exact float32 unpacking, so results do not depend on
which form the model holds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from servefleet.engine.kernels.cpu_small_gemm import CpuSmallGemm, load_cpu_small_gemm
from servefleet.engine.kernels.packed_weights import PackedWeight, unpack


class Matmul(Protocol):
    """`mm`: x [M, K] @ w [K, N] (+ bias); `linear`: x [M, K] @ w[N, K].T.

    The weight comes as a float32 tensor or, when the model keeps only that, as its
    packed form ([K, N] in `packed_weights` layout, for both calls).
    """

    @property
    def name(self) -> str: ...

    def mm(
        self,
        x: torch.Tensor,
        weight_in_out: torch.Tensor | PackedWeight,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def linear(
        self, x: torch.Tensor, weight_out_in: torch.Tensor | PackedWeight
    ) -> torch.Tensor: ...


def dense_weight(packed: PackedWeight) -> torch.Tensor:
    """The float32 W [K, N] of a packed weight: the C unpacking when it builds, else numpy
    (the same bits either way)."""
    kernel = load_cpu_small_gemm()
    return unpack(packed) if kernel is None else kernel.unpack(packed)


@dataclass(frozen=True)
class TorchMatmul:
    """`torch.mm` / `torch.addmm` / `F.linear`: what the model did before backends existed."""

    name: str = "torch"

    def mm(
        self,
        x: torch.Tensor,
        weight_in_out: torch.Tensor | PackedWeight,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(weight_in_out, PackedWeight):
            weight_in_out = dense_weight(weight_in_out)
        if bias is None:
            return torch.mm(x, weight_in_out)
        return torch.addmm(bias, x, weight_in_out)

    def linear(self, x: torch.Tensor, weight_out_in: torch.Tensor | PackedWeight) -> torch.Tensor:
        if isinstance(weight_out_in, PackedWeight):
            return torch.mm(x, dense_weight(weight_out_in))
        return F.linear(x, weight_out_in)


TORCH_MATMUL = TorchMatmul()


def _fits_rows(x: torch.Tensor, max_rows: int, k: int) -> bool:
    return (
        x.dim() == 2
        and x.shape[0] <= max_rows
        and x.shape[1] == k
        and x.dtype == torch.float32
        and x.is_cpu
        and x.is_contiguous()
    )


def _fits_kernel(x: torch.Tensor, weight: torch.Tensor, max_rows: int, k_dim: int) -> bool:
    """Everything the dense C kernels need; anything else goes to torch (which also
    reports shape errors in its own words)."""
    return (
        weight.dim() == 2
        and _fits_rows(x, max_rows, weight.shape[k_dim])
        and weight.dtype == torch.float32
        and weight.is_cpu
        and weight.is_contiguous()
    )


class UnpackScratch(threading.local):
    """One buffer per weight shape and dtype (and thread) that many-row calls unpack packed
    weights, or round float32 ones, into: unpacking into fresh memory cost ~5x the
    unpacking itself (page faults), which made a prefill step ~70% slower than on float32
    weights; reused, ~8%."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def _buffer(self, k: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self.buffers.get((k, n, dtype))
        if buffer is None:
            buffer = self.buffers[(k, n, dtype)] = torch.empty(k, n, dtype=dtype)
        return buffer

    def unpacked(
        self, kernel: CpuSmallGemm, weight: PackedWeight, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """W [K, N] in `dtype`, in this thread's buffer for the shape: valid until the next call."""
        return kernel.unpack(weight, out=self._buffer(weight.k, weight.n, dtype))

    def rounded(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A float32 weight copied into `dtype`, in this thread's buffer for the shape."""
        return self._buffer(weight.shape[0], weight.shape[1], dtype).copy_(weight)


# Fewest rows a call needs before `bf16_min_rows`-style bfloat16 pays: below 8 rows the
# packed kernel's conversions cost more than its halved multiply-adds save (measured on
# SmolLM2's Q4_1/Q8_0 shapes: 0.8x at 1 row, 1.0x at 4, 1.3x at 8, 1.5x at 16).
BF16_MIN_ROWS = 8


@dataclass(frozen=True)
class SmallRowsMatmul:
    """The C kernels for calls of at most `max_rows` rows (float32, CPU, contiguous).

    Larger calls (prefill) and anything the kernels do not take go to torch, where
    MKL's blocked GEMM is faster once the weights are reused across many rows (a packed
    weight is unpacked for the call). One limit for both layouts: then a whole decode
    step of up to `max_rows` sequences runs on the C kernels and every sequence's logits
    are bitwise independent of the batch.

    `bf16_min_rows` (None: off) runs every call of at least that many rows in bfloat16 —
    x and W rounded, products summed in float32: larger `mm` calls through oneDNN (~2.7x
    float32's rate where the CPU multiplies bfloat16 natively), and packed weights' calls up
    to `max_rows` through the C kernel's bfloat16 products where it has them
    (`CpuSmallGemm.bf16_products`, ~1.5x at 16 rows). A sequence's result then depends on
    how many rows its step had; the lm_head's larger calls stay float32.

    `invariant` (batch-invariant mode): float32 CPU calls of more than `max_rows` rows
    run as `max_rows`-row calls of the C kernels, so every row's bits are what a decode
    step gives it (slower than MKL for prompts).
    """

    kernel: CpuSmallGemm
    max_rows: int
    name: str = "cpu-c"
    bf16_min_rows: int | None = None
    invariant: bool = False
    scratch: UnpackScratch = field(default_factory=UnpackScratch, compare=False, repr=False)

    def bf16_rows(self, rows: int) -> bool:
        """Whether a call of `rows` rows runs in bfloat16 products."""
        return self.bf16_min_rows is not None and rows >= self.bf16_min_rows

    def _packed_bf16(self, rows: int) -> bool:
        return self.bf16_rows(rows) and self.kernel.bf16_products

    def _split(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """`max_rows`-row parts of a larger float32 CPU call in invariant mode, else None."""
        if not (self.invariant and x.dim() == 2 and x.shape[0] > self.max_rows):
            return None
        if x.dtype != torch.float32 or not x.is_cpu:
            return None
        return list(x.contiguous().split(self.max_rows))

    def mm(
        self,
        x: torch.Tensor,
        weight_in_out: torch.Tensor | PackedWeight,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        parts = self._split(x)
        if parts is not None:
            return torch.cat([self.mm(part, weight_in_out, bias) for part in parts])
        if isinstance(weight_in_out, PackedWeight):
            if not _fits_rows(x, self.max_rows, weight_in_out.k):
                return self._many_rows_mm(x, weight_in_out, bias)
            bf16 = self._packed_bf16(x.shape[0])
            out = self.kernel.packed_mm_unchecked(x, weight_in_out, bf16)
        elif _fits_kernel(x, weight_in_out, self.max_rows, 0):
            out = self.kernel.mm_unchecked(x, weight_in_out)
        else:
            return self._many_rows_mm(x, weight_in_out, bias)
        return out if bias is None else out.add_(bias)

    def _many_rows_mm(
        self, x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rounds = (
            x.dtype == torch.float32
            and x.dim() == 2
            and x.shape[0] > self.max_rows
            and self.bf16_rows(x.shape[0])
        )
        dtype = torch.bfloat16 if rounds else torch.float32
        if isinstance(weight, PackedWeight):
            weight = self.scratch.unpacked(self.kernel, weight, dtype)
        elif rounds and weight.dtype == torch.float32 and weight.dim() == 2:
            weight = self.scratch.rounded(weight, dtype)
        if not rounds or weight.dtype != dtype:
            return TORCH_MATMUL.mm(x, weight, bias)
        out = torch.mm(x.to(dtype), weight).to(torch.float32)
        return out if bias is None else out.add_(bias)

    def linear(self, x: torch.Tensor, weight_out_in: torch.Tensor | PackedWeight) -> torch.Tensor:
        parts = self._split(x)
        if parts is not None:
            return torch.cat([self.linear(part, weight_out_in) for part in parts])
        if isinstance(weight_out_in, PackedWeight):
            if not _fits_rows(x, self.max_rows, weight_out_in.k):
                return torch.mm(x, self.scratch.unpacked(self.kernel, weight_out_in))
            bf16 = self._packed_bf16(x.shape[0])
            return self.kernel.packed_mm_unchecked(x, weight_out_in, bf16)
        if not _fits_kernel(x, weight_out_in, self.max_rows, 1):
            return TORCH_MATMUL.linear(x, weight_out_in)
        return self.kernel.linear_unchecked(x, weight_out_in)
