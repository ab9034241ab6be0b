"""Triton decode attention over the paged KV cache (CUDA; CPU only under TRITON_INTERPRET=1).

One program per (sequence, query head) walks the sequence's block table one
page at a time with an online softmax, so nothing is gathered or padded. Triton
is imported lazily: the engine must import on machines without it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch

from servefleet.engine.kernels.validation import validate_decode_inputs

INTERPRET_ENV = "TRITON_INTERPRET"


def interpreter_enabled() -> bool:
    """Triton reads this when a kernel is defined, so it is checked per build."""
    return os.environ.get(INTERPRET_ENV, "0").lower() in ("1", "true", "on")


def triton_unavailable(device_type: str) -> str | None:
    """Why the Triton kernel cannot run on `device_type` here, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    if device_type == "cuda":
        return None if torch.cuda.is_available() else "CUDA is not available"
    if device_type == "cpu" and interpreter_enabled():
        return None
    return f"no Triton backend for {device_type} (CPU needs {INTERPRET_ENV}=1)"


@functools.cache
def _build_kernel(interpret: bool) -> Any:
    """Define the @triton.jit kernel on first use; keyed by the interpreter flag because
    triton decides at definition time whether to compile or interpret."""
    del interpret  # only part of the cache key
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        lens_ptr,
        out_ptr,
        scale,
        max_blocks,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_SIZE_PAD: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        slots = tl.arange(0, BLOCK_SIZE_PAD)
        log2e: tl.constexpr = 1.4426950408889634

        q_row = (seq * NUM_HEADS + head) * HEAD_DIM
        q = tl.load(q_ptr + q_row + dims, mask=dim_ok, other=0.0).to(tl.float32)
        q = q * (scale * log2e)  # scores in base 2: exp2 is the native instruction
        length = tl.load(lens_ptr + seq)

        run_max = tl.max(tl.full([BLOCK_SIZE_PAD], float("-inf"), tl.float32), axis=0)
        run_sum = tl.sum(tl.zeros([BLOCK_SIZE_PAD], tl.float32), axis=0)
        acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
        num_pages = tl.cdiv(length, BLOCK_SIZE)
        for page in range(0, num_pages):
            block_id = tl.load(tables_ptr + seq * max_blocks + page).to(tl.int64)
            visible = (slots < BLOCK_SIZE) & (page * BLOCK_SIZE + slots < length)
            offsets = (
                (block_id * BLOCK_SIZE + slots[:, None]) * (NUM_KV_HEADS * HEAD_DIM)
                + kv_head * HEAD_DIM
                + dims[None, :]
            )
            mask = visible[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], axis=1)
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(scores, axis=0))
            alpha = tl.exp2(run_max - new_max)
            probs = tl.exp2(scores - new_max)
            v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(probs[:, None] * v, axis=0)
            run_sum = run_sum * alpha + tl.sum(probs, axis=0)
            run_max = new_max
        out = acc / run_sum
        tl.store(out_ptr + q_row + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)

    return paged_decode_kernel


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def triton_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`DecodeKernel` on the Triton kernel; inputs as for `torch_paged_decode`.

    Block ids and context lengths are not range-checked on the device (that would
    cost a host sync per layer); the engine builds them, tests cover them.
    """
    device_type = q.device.type
    reason = triton_unavailable(device_type)
    if reason is not None:
        raise RuntimeError(f"triton paged decode: {reason}")
    shape = validate_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, device_type)
    out = torch.empty_like(q)
    if shape.num_seqs == 0:
        return out
    kernel = _build_kernel(interpreter_enabled())
    kernel[(shape.num_seqs, shape.num_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        float(scale),
        shape.max_blocks,
        NUM_HEADS=shape.num_heads,
        NUM_KV_HEADS=shape.num_kv_heads,
        HEAD_DIM=shape.head_dim,
        HEAD_DIM_PAD=_next_power_of_2(shape.head_dim),
        BLOCK_SIZE=shape.block_size,
        BLOCK_SIZE_PAD=_next_power_of_2(shape.block_size),
    )
    return out
