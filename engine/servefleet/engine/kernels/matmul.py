"""The matmuls a decoder makes, behind one small interface the model is handed.

The model calls `mm` for its [in, out] projection weights and `linear` for the
[out, in] lm_head, so a backend can pick a kernel per call (by row count, dtype,
device) without the model knowing; `TORCH_MATMUL` is the default everywhere. When the
checkpoint was quantized, the model also hands over the weight's packed form, which a
backend may read instead of the float32 tensor (same values, a fraction of the bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from servefleet.engine.kernels.cpu_small_gemm import CpuSmallGemm
from servefleet.engine.kernels.packed_weights import PackedWeight


class Matmul(Protocol):
    """`mm`: x [M, K] @ w [K, N] (+ bias); `linear`: x [M, K] @ w[N, K].T.

    `packed`, when given, holds the same weight as [K, N] in `packed_weights` layout.
    """

    @property
    def name(self) -> str: ...

    def mm(
        self,
        x: torch.Tensor,
        weight_in_out: torch.Tensor,
        bias: torch.Tensor | None = None,
        packed: PackedWeight | None = None,
    ) -> torch.Tensor: ...

    def linear(
        self, x: torch.Tensor, weight_out_in: torch.Tensor, packed: PackedWeight | None = None
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class TorchMatmul:
    """`torch.mm` / `torch.addmm` / `F.linear`: what the model did before backends existed."""

    name: str = "torch"

    def mm(
        self,
        x: torch.Tensor,
        weight_in_out: torch.Tensor,
        bias: torch.Tensor | None = None,
        packed: PackedWeight | None = None,
    ) -> torch.Tensor:
        if bias is None:
            return torch.mm(x, weight_in_out)
        return torch.addmm(bias, x, weight_in_out)

    def linear(
        self, x: torch.Tensor, weight_out_in: torch.Tensor, packed: PackedWeight | None = None
    ) -> torch.Tensor:
        return F.linear(x, weight_out_in)


TORCH_MATMUL = TorchMatmul()


def _fits_kernel(x: torch.Tensor, weight: torch.Tensor, max_rows: int, k_dim: int) -> bool:
    """Everything the C kernels need; anything else goes to torch (which also reports
    shape errors in its own words)."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and x.shape[0] <= max_rows
        and x.shape[1] == weight.shape[k_dim]
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.is_cpu
        and weight.is_cpu
        and x.is_contiguous()
        and weight.is_contiguous()
    )


@dataclass(frozen=True)
class SmallRowsMatmul:
    """The C kernels for calls of at most `max_rows` rows (float32, CPU, contiguous).

    Larger calls (prefill) and anything the kernels do not take go to torch, where
    MKL's blocked GEMM is faster once the weights are reused across many rows. One
    limit for both layouts: then a whole decode step of up to `max_rows` sequences runs
    on the C kernels and every sequence's logits are bitwise independent of the batch.
    A packed weight is read instead of the float32 one whenever it is given.
    """

    kernel: CpuSmallGemm
    max_rows: int
    name: str = "cpu-c"

    def mm(
        self,
        x: torch.Tensor,
        weight_in_out: torch.Tensor,
        bias: torch.Tensor | None = None,
        packed: PackedWeight | None = None,
    ) -> torch.Tensor:
        if not _fits_kernel(x, weight_in_out, self.max_rows, 0):
            return TORCH_MATMUL.mm(x, weight_in_out, bias)
        if packed is None:
            out = self.kernel.mm_unchecked(x, weight_in_out)
        else:
            out = self.kernel.packed_mm_unchecked(x, packed)
        return out if bias is None else out.add_(bias)

    def linear(
        self, x: torch.Tensor, weight_out_in: torch.Tensor, packed: PackedWeight | None = None
    ) -> torch.Tensor:
        if not _fits_kernel(x, weight_out_in, self.max_rows, 1):
            return TORCH_MATMUL.linear(x, weight_out_in)
        if packed is None:
            return self.kernel.linear_unchecked(x, weight_out_in)
        return self.kernel.packed_mm_unchecked(x, packed)
