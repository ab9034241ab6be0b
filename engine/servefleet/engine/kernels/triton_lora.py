"""A step's LoRA deltas in Triton (CUDA; CPU only under TRITON_INTERPRET=1): Punica's BGMV.

Every row and adapter of the step in one launch per projection (`lora_bgmv`, one program
per row, part and block of columns: v = x[row] @ A[slot][:, part's ranks], then out[row,
its block of the part's columns] += v @ B[slot]) up to FUSED_MAX_ROWS rows, else in two
(`shrink`, one program per (row, part), writes v; `expand` adds v @ B per block). The fused
kernel recomputes v in every block of a row, which costs nothing while the step is
launch-bound and more than the second launch once it is not. Measured on an H200 (one
decode step's LoRA products, every layer, bf16, `lora_gpu_check`): 16 rows on 8 adapters,
SmolLM2 shapes 4.95 ms fused vs 9.62 ms in two launches, Llama-3-8B shapes 10.9 vs 14.9 ms;
64 rows on 32 adapters at Llama-3-8B shapes 24.9 vs 16.7 ms.
Each row reads its adapter's weights through the step's table of addresses
(`lora_layout`), so rows of any adapters mix in one launch and nothing is gathered,
sorted or copied per adapter. Operands are widened to float32 and summed in float32 (no
TF32), then added to `out` in its dtype. Triton is imported lazily, as for the attention
kernel (`triton_paged_decode`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from servefleet.engine.kernels.lora_layout import FIELDS, MAX_PARTS, LoraStep
from servefleet.engine.kernels.triton_paged_decode import interpreter_enabled, triton_unavailable

BLOCK_K = 64  # columns of x per shrink iteration
BLOCK_N = 128  # output columns per expand program
BLOCK_N_FUSED = 256  # output columns per fused program (each recomputes its row's v)
FUSED_MAX_ROWS = 16  # the fused kernel up to this many rows (measured: module docstring)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _build_kernels(interpret: bool) -> tuple[Any, Any, Any]:
    """Define the @triton.jit kernels on first use (keyed by the interpreter flag, which
    triton reads when a kernel is defined). The fused kernel repeats the shrink and expand
    bodies: triton finds a called @jit function in module globals, not in this closure, and
    module-level kernels would import triton with this module."""
    del interpret  # only part of the cache key
    import triton
    import triton.language as tl

    @triton.jit
    def lora_bgmv(x_ptr, out_ptr, slots_ptr, table_ptr, entry0, slot_stride, k, n,
                  W_DTYPE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                  R_PAD: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        block = tl.program_id(2)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        if slot >= 0:
            e = table_ptr + slot * slot_stride + entry0
            if part < tl.load(e + 3):
                q = e + 4 + 5 * part  # j0, r, c0, width, b
                width = tl.load(q + 3)
                if block * BLOCK_N < width:
                    # shrink: v = x[row] @ A[:, the part's ranks], k ascending in float32
                    a = tl.load(e).to(tl.pointer_type(W_DTYPE))
                    rank_total = tl.load(e + 2)
                    j0 = tl.load(q)
                    ranks = tl.arange(0, R_PAD)
                    rmask = ranks < tl.load(q + 1)
                    v = tl.zeros([R_PAD], tl.float32)
                    for k0 in range(0, k, BLOCK_K):
                        ks = k0 + tl.arange(0, BLOCK_K)
                        kmask = ks < k
                        xv = tl.load(x_ptr + row * k + ks, mask=kmask, other=0.0).to(tl.float32)
                        w = tl.load(a + ks[:, None] * rank_total + j0 + ranks[None, :],
                                    mask=kmask[:, None] & rmask[None, :], other=0.0)  # fmt: skip
                        v += tl.sum(xv[:, None] * w.to(tl.float32), axis=0)
                    # expand: out[row, this block of the part's columns] += v @ B
                    b = tl.load(q + 4).to(tl.pointer_type(W_DTYPE))
                    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
                    cmask = cols < width
                    w = tl.load(b + ranks[:, None] * width + cols[None, :],
                                mask=rmask[:, None] & cmask[None, :], other=0.0)  # fmt: skip
                    delta = tl.sum(v[:, None] * w.to(tl.float32), axis=0)
                    o = out_ptr + row * n + tl.load(q + 2) + cols
                    now = tl.load(o, mask=cmask, other=0.0).to(tl.float32)
                    tl.store(o, (now + delta).to(out_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def lora_shrink(x_ptr, v_ptr, slots_ptr, table_ptr, entry0, slot_stride, k, ldv,
                    W_DTYPE: tl.constexpr, BLOCK_K: tl.constexpr, R_PAD: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        if slot >= 0:
            e = table_ptr + slot * slot_stride + entry0
            if part < tl.load(e + 3):
                a = tl.load(e).to(tl.pointer_type(W_DTYPE))
                rank_total = tl.load(e + 2)
                j0 = tl.load(e + 4 + 5 * part)
                ranks = tl.arange(0, R_PAD)
                rmask = ranks < tl.load(e + 5 + 5 * part)
                acc = tl.zeros([R_PAD], tl.float32)
                for k0 in range(0, k, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    kmask = ks < k
                    xv = tl.load(x_ptr + row * k + ks, mask=kmask, other=0.0).to(tl.float32)
                    w = tl.load(a + ks[:, None] * rank_total + j0 + ranks[None, :],
                                mask=kmask[:, None] & rmask[None, :], other=0.0)  # fmt: skip
                    acc += tl.sum(xv[:, None] * w.to(tl.float32), axis=0)
                tl.store(v_ptr + row * ldv + j0 + ranks, acc, mask=rmask)

    @triton.jit
    def lora_expand(v_ptr, out_ptr, slots_ptr, table_ptr, entry0, slot_stride, n, ldv,
                    W_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        block = tl.program_id(2)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        if slot >= 0:
            e = table_ptr + slot * slot_stride + entry0
            if part < tl.load(e + 3):
                q = e + 4 + 5 * part  # j0, r, c0, width, b
                width = tl.load(q + 3)
                if block * BLOCK_N < width:
                    b = tl.load(q + 4).to(tl.pointer_type(W_DTYPE))
                    ranks = tl.arange(0, R_PAD)
                    rmask = ranks < tl.load(q + 1)
                    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
                    cmask = cols < width
                    v = tl.load(v_ptr + row * ldv + tl.load(q) + ranks, mask=rmask, other=0.0)
                    w = tl.load(b + ranks[:, None] * width + cols[None, :],
                                mask=rmask[:, None] & cmask[None, :], other=0.0)  # fmt: skip
                    delta = tl.sum(v[:, None] * w.to(tl.float32), axis=0)
                    o = out_ptr + row * n + tl.load(q + 2) + cols
                    now = tl.load(o, mask=cmask, other=0.0).to(tl.float32)
                    tl.store(o, (now + delta).to(out_ptr.dtype.element_ty), mask=cmask)

    return lora_bgmv, lora_shrink, lora_expand


def _triton_dtype(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[
        dtype
    ]


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fits(x: torch.Tensor, out: torch.Tensor, step: LoraStep) -> bool:
    """What the kernels read: 2-D contiguous x and out of a float dtype on the step's
    device, where Triton runs (CUDA, or the CPU under the interpreter)."""
    device = step.table.device
    return (
        x.dim() == 2
        and out.dim() == 2
        and x.shape[0] == out.shape[0] == step.row_slots.shape[0]
        and x.dtype in _FLOATS
        and out.dtype in _FLOATS
        and step.weight_dtype in _FLOATS
        and x.is_contiguous()
        and out.is_contiguous()
        and x.device == out.device == device == step.row_slots.device
        and step.row_slots.dtype == torch.int32
        and step.table.dtype == torch.int64
        and step.table.dim() == 4
        and step.table.shape[-1] == FIELDS
        and step.table.is_contiguous()
        and triton_unavailable(device.type) is None
    )


@dataclass(frozen=True)
class TritonLoraKernel:
    """`LoraKernel` on Triton; `calls` counts the projections it added."""

    name: str = "triton"
    calls: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    def add(
        self, x: torch.Tensor, out: torch.Tensor, step: LoraStep, layer: int, projection: int
    ) -> bool:
        if not fits(x, out, step):
            return False
        _, layers, projections, _ = step.table.shape
        if not (0 <= layer < layers and 0 <= projection < projections):
            raise ValueError(f"lora: no layer {layer} / projection {projection} in the table")
        rows = x.shape[0]
        if rows == 0:
            return True
        fused, shrink, expand = _build_kernels(interpreter_enabled())
        entry0, stride = (layer * projections + projection) * FIELDS, layers * projections * FIELDS
        w_dtype, k, n = _triton_dtype(step.weight_dtype), x.shape[1], out.shape[1]
        r_pad = max(4, _next_power_of_2(step.max_rank))
        if rows <= FUSED_MAX_ROWS:
            fused[(rows, MAX_PARTS, -(-n // BLOCK_N_FUSED))](
                x, out, step.row_slots, step.table, entry0, stride, k, n,
                W_DTYPE=w_dtype, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N_FUSED, R_PAD=r_pad,
            )  # fmt: skip
        else:
            ldv = MAX_PARTS * step.max_rank
            v = torch.empty(rows, ldv, dtype=torch.float32, device=x.device)
            shrink[(rows, MAX_PARTS)](
                x, v, step.row_slots, step.table, entry0, stride, k, ldv,
                W_DTYPE=w_dtype, BLOCK_K=BLOCK_K, R_PAD=r_pad,
            )  # fmt: skip
            expand[(rows, MAX_PARTS, -(-n // BLOCK_N))](
                v, out, step.row_slots, step.table, entry0, stride, n, ldv,
                W_DTYPE=w_dtype, BLOCK_N=BLOCK_N, R_PAD=r_pad,
            )  # fmt: skip
        self.calls[0] += 1
        return True


TRITON_LORA = TritonLoraKernel()
