"""Shape/dtype checks shared by the decode kernels.

The native kernels read raw memory, so a wrong stride or dtype would read
garbage (or crash) instead of raising; every kernel checks its inputs here first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servefleet.engine.kv_quant import row_width

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT8_CACHE_DTYPES = (*CACHE_DTYPES, torch.int8)  # kernels that read kv_quant's int8 rows
QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DecodeShape:
    """Sizes of one decode call, read off validated inputs."""

    num_seqs: int
    num_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    max_blocks: int


def _first_problem(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    device_type: str,
    cache_dtypes: tuple[torch.dtype, ...],
) -> str | None:
    """Messages are only formatted on failure: this runs once per layer per step."""
    if q.dim() != 3:
        return f"q must be [num_seqs, num_heads, head_dim], got shape {tuple(q.shape)}"
    if k_cache.dim() != 4:
        return (
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        return f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, cache_head_dim = k_cache.shape[2], k_cache.shape[3]
    if cache_head_dim != row_width(head_dim, k_cache.dtype):
        return f"cache row width {cache_head_dim} does not fit q head_dim {head_dim}"
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        return f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
    if q.dtype not in QUERY_DTYPES:
        return f"q dtype {q.dtype} not in {QUERY_DTYPES}"
    if k_cache.dtype not in cache_dtypes:
        return f"cache dtype {k_cache.dtype} not in {cache_dtypes}"
    if v_cache.dtype != k_cache.dtype:
        return f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}"
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        return (
            f"block_tables must be [num_seqs={num_seqs}, max_blocks], "
            f"got shape {tuple(block_tables.shape)}"
        )
    if context_lens.dim() != 1 or context_lens.shape[0] != num_seqs:
        return f"context_lens must be [num_seqs={num_seqs}], got shape {tuple(context_lens.shape)}"
    if block_tables.dtype != torch.int32:
        return f"block_tables must be int32, got {block_tables.dtype}"
    if context_lens.dtype != torch.int32:
        return f"context_lens must be int32, got {context_lens.dtype}"
    tensors = (q, k_cache, v_cache, block_tables, context_lens)
    names = ("q", "k_cache", "v_cache", "block_tables", "context_lens")
    for name, tensor in zip(names, tensors, strict=True):
        if not tensor.is_contiguous():
            return f"{name} must be contiguous"
        if tensor.device.type != device_type:
            return f"{name} is on {tensor.device}, this kernel needs {device_type} tensors"
    return None


def validate_decode_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    device_type: str,
    cache_dtypes: tuple[torch.dtype, ...] = CACHE_DTYPES,
) -> DecodeShape:
    """Raise ValueError naming the first bad argument; return the call's sizes."""
    problem = _first_problem(
        q, k_cache, v_cache, block_tables, context_lens, device_type, cache_dtypes
    )
    if problem is not None:
        raise ValueError(f"paged decode: {problem}")
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    return DecodeShape(
        num_seqs=num_seqs,
        num_heads=num_heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        max_blocks=block_tables.shape[1],
    )
