"""int8 KV-cache rows: quantize on write, widen on read.

Choice: one float32 scale per (token, kv head), stored in the last 4 bytes of that
head's row, so a cached row is `head_dim` int8 values then its scale ([..., head_dim + 4]
int8). Why per token rather than per (block, head): a block fills one token at a time, and
a shared scale that grows with a later token would have to requantize the tokens already
written (or clip them); a per-token scale is written once with its row and never changes,
so a prefix-cache hit or a decode step reads exactly what the prefill wrote. Why inline:
the cache stays one tensor per layer and side, and a block carries its own scales, so block
tables, prefix caching and every kernel's addressing work unchanged.

Symmetric absmax: scale = max|x| / 127, q = round(x / scale), so |x - q * scale| <=
scale / 2 = max|x| / 254 per element. Capacity: head_dim + 4 bytes per row against
4 * head_dim (float32) or 2 * head_dim (float16); for head_dim 64 that is 3.76x and 1.88x
the tokens, not 4x and 2x, the scales costing 4 of every 68 bytes.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 per row
QMAX = 127.0


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per (token, kv head) row of a cache of `dtype`."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [..., head_dim] float -> [..., head_dim + 4] int8 with each row's scale inline."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True) / QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays 0
    values = torch.round(x32 / safe).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat((values, scale.view(torch.int8)), dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """[..., head_dim + 4] int8 -> [..., head_dim] float32."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return rows[..., :head_dim].float() * scale


def widen(cache_rows: torch.Tensor) -> torch.Tensor:
    """Rows read from a cache, as floats: int8 rows dequantized, float rows unchanged."""
    return dequantize_rows(cache_rows) if is_quantized(cache_rows) else cache_rows


def write_rows(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """Store x [T, kvh, head_dim] at the flat slots of cache [blocks, block_size, kvh, row]."""
    rows = quantize_rows(x) if is_quantized(cache) else x.to(cache.dtype)
    cache.view(-1, cache.shape[2], cache.shape[3]).index_copy_(0, slot_mapping, rows)
